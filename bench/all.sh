#!/usr/bin/env bash
# Every benchmark of docs/benchmarks.md, one after another, with the settings the docs report; each writes its
# JSON result to bench/results/ and prints its table. Nothing else should run meanwhile (2 cores: any other
# torch process slows both sides several-fold). Several hours on the 2-core CPU; needs `pip install -e .[bench]`.
#   bench/all.sh [name ...]    # default: all of sampler sampler-turns step-time memory learning ruler credit
# memory: the main job with a LoRA adapter; its peak RSS (per phase) is in the run's report.json
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
run() {
    echo "== $1: ${*:2}" >&2
    "$PY" "${@:2}"
}
for name in "${@:-sampler sampler-turns step-time memory learning ruler credit}"; do
    for one in $name; do
        case "$one" in
            sampler) run "$one" bench/sampler.py --runs 3 ;;
            sampler-turns) run "$one" bench/sampler.py --runs 3 --turns 3 ;;
            step-time) run "$one" bench/step_time.py --runs 3 --steps 3 ;;
            memory) echo "== memory" >&2; .venv/bin/flywheel train --lora --name "memory-$(date +%Y%m%d-%H%M%S)" ;;
            learning) run "$one" bench/learning.py ;;
            ruler) run "$one" bench/ruler_tokens.py ;;
            credit) run "$one" bench/credit.py ;;
            *) echo "unknown benchmark: $one" >&2; exit 2 ;;
        esac
    done
done
