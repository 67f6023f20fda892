#!/usr/bin/env bash
# A rollout-queue runner in shell (curl + jq; without jq, python3 reads and writes the JSON): claims one attempt,
# runs a toy agent (one chat completion through the attempt's episode URL), and completes it with a reward.
# The protocol is in docs/user-guide.md, "Runners". Usage: examples/gateway/runner.sh [http://127.0.0.1:8000]
# The task's payload here: {"prompt": "...", "expected": "..."}; the reward is 1 if the reply contains `expected`.
# Environment: FLYWHEEL_API_KEY (a runner key, if the server has keys), JSON_TOOL=jq|python3 (default: jq if any).
set -euo pipefail
URL=${1:-http://127.0.0.1:8000}
JSON_TOOL=${JSON_TOOL:-$(command -v jq >/dev/null && echo jq || echo python3)}
HEADERS=(-H "Content-Type: application/json")
if [ -n "${FLYWHEEL_API_KEY:-}" ]; then HEADERS+=(-H "Authorization: Bearer $FLYWHEEL_API_KEY"); fi

get() {  # get FIELD < json: a field such as .payload.prompt or .choices[0].message.content, as text
  if [ "$JSON_TOOL" = jq ]; then jq -r "$1 // empty"; else python3 -c '
import json, re, sys
value = json.load(sys.stdin)
for key in re.findall(r"\w+", sys.argv[1]):
    value = value[int(key)] if isinstance(value, list) else (value or {}).get(key)
print("" if value is None else value)' "$1"; fi
}
json() {  # json KEY VALUE ...: an object of string values; a key written KEY:raw takes its value as JSON
  if [ "$JSON_TOOL" = jq ]; then
    local args=() fields=()
    while [ $# -gt 0 ]; do
      case $1 in *:raw) args+=(--argjson "${1%:raw}" "$2") ;; *) args+=(--arg "$1" "$2") ;; esac
      fields+=("${1%:raw}: \$${1%:raw}"); shift 2
    done
    jq -nc "${args[@]}" "{$(IFS=,; echo "${fields[*]}")}"
  else python3 -c '
import json, sys
pairs = zip(sys.argv[1::2], sys.argv[2::2])
print(json.dumps({k.removesuffix(":raw"): json.loads(v) if k.endswith(":raw") else v for k, v in pairs}))' "$@"; fi
}
post() {  # post URL BODY: prints the response body; fails on an HTTP error status
  curl -sS --fail-with-body "${HEADERS[@]}" -X POST "$1" -d "$2"
}

# 1. claim: 200 with the attempt, or 204 when nothing is queued
lease=$(curl -sS "${HEADERS[@]}" -w '\n%{http_code}' -X POST "$URL/tasks/claim" \
  -d "$(json runner "shell-$HOSTNAME-$$" lease_seconds:raw 60)")
status=${lease##*$'\n'}
lease=${lease%$'\n'*}
if [ "$status" = 204 ]; then echo "nothing queued"; exit 0; fi
if [ "$status" != 200 ]; then echo "claim refused ($status): $lease" >&2; exit 1; fi
attempt=$(get .id <<<"$lease")
episode=$(get .episode_id <<<"$lease")
base_url=$(get .base_url <<<"$lease")
echo "attempt $attempt of task $(get .task_id <<<"$lease"): episode $episode"

# 2. heartbeat every 20 s while the agent runs (a lease lasts 60 s unrenewed); a refusal means the lease is lost.
# The sleep writes nowhere: it outlives the runner (only the loop is killed), and holding the runner's stdout it kept
# a caller that reads it ($(runner.sh), runner.sh | tee log, a supervisor's pipe) waiting up to 20 s more.
(while sleep 20 >/dev/null 2>&1; do post "$URL/attempts/$attempt/heartbeat" "$(json episode_id "$episode")" >/dev/null || exit; done) &
heartbeat=$!
trap 'kill $heartbeat 2>/dev/null || true' EXIT

# 3. the agent: any OpenAI client pointed at base_url; here one chat completion with curl
message=$(json role user content "$(get .payload.prompt <<<"$lease")")
request=$(json model "$(get .model <<<"$lease")" messages:raw "[$message]" max_tokens:raw 16)
if ! reply=$(post "$base_url/chat/completions" "$request"); then
  # no result: give the attempt back (it is requeued, one try counted)
  post "$URL/attempts/$attempt/fail" "$(json episode_id "$episode" reason "chat completion failed: $reply")" >/dev/null
  echo "attempt $attempt given back: $reply" >&2
  exit 1
fi
answer=$(get '.choices[0].message.content' <<<"$reply")
expected=$(get .payload.expected <<<"$lease")
reward=0
if [ -n "$expected" ] && [[ "$answer" == *"$expected"* ]]; then reward=1; fi

# 4. complete: the reward finishes the episode and the attempt (a 409 if the lease was lost meanwhile)
if ! result=$(post "$URL/attempts/$attempt/complete" "$(json episode_id "$episode" reward:raw "$reward")"); then
  echo "result refused: $result" >&2
  exit 1
fi
echo "attempt $attempt: reward $reward (answer: ${answer:0:60})"
