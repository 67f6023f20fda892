// Flywheel's dashboard: a single page over /ui/api (flywheel/dashboard/api.py), routed by the URL's hash:
//   #/runs                                      the runs
//   #/run/<project>/<name>                      a run: its curves and checkpoints
//   #/run/<project>/<name>/rollouts             its saved trajectories by split and step
//   #/run/<project>/<name>/groups?split=&step=  a step's groups, each ranked by reward
//   #/run/<project>/<name>/group?split=&step=&index=  one group side by side
//   #/trajectory/<id>                           one trajectory as a chat
//   #/loop?model=&timeline=&audit=&episodes=    the loop: deployments, promotion timeline, audit trail, production
//                                               episodes, review agreement (the three lists' page offsets)
//   #/event/<id>                                one audit event with its details
//   #/approvals                                 high-impact tool calls waiting for a person: approve or deny
// Every view is polled while the page is visible and redrawn only when its data changed. Text from the API is
// always set as text (never parsed as HTML).

const POLL_MS = 4000;
const PAGE = 50; // the API's page size (flywheel/dashboard/common.py)
const KEY = "flywheel-api-key"; // an admin key, when the server has keys (kept for this tab only)
const REVIEWER = "flywheel-reviewer"; // who decides approvals in this browser (the audit events' actor)
const BY_LOGPROB = "flywheel-by-logprob"; // a trajectory's tokens coloured by their log-probs (kept for this tab)

const view = document.getElementById("view");
const live = document.getElementById("live");
let shown = ""; // the data of the view on screen (JSON), to redraw only on a change
let charts = [];
let byLogprob = sessionStorage.getItem(BY_LOGPROB) === "1";

// ---- helpers -----------------------------------------------------------------------------------------------------

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

const enc = encodeURIComponent;
const runPath = (project, name) => `${enc(project)}/${enc(name)}`;
const num = (v, digits = 3) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits).replace(/\.?0+$/, "") || "0");

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.round(seconds);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

function ago(time) {
  return time === null || time === undefined ? "–" : `${duration(Date.now() / 1000 - time)} ago`;
}

function table(caption, headers, rows) {
  return h(
    "div",
    { class: "table-wrap" },
    h(
      "table",
      {},
      h("caption", {}, caption),
      h("thead", {}, h("tr", {}, headers.map((title) => h("th", { scope: "col" }, title)))),
      h("tbody", {}, rows),
    ),
  );
}

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// GET ``path`` of the API, or POST ``body`` (JSON) to it.
async function api(path, body) {
  const key = sessionStorage.getItem(KEY);
  const headers = { ...(key ? { "X-API-Key": key } : {}), ...(body ? { "Content-Type": "application/json" } : {}) };
  const response = await fetch(`api${path}`, body ? { method: "POST", headers, body: JSON.stringify(body) } : { headers });
  const answer = await response.json().catch(() => ({}));
  if (!response.ok) {
    const message = answer.error?.message ?? JSON.stringify(answer.detail ?? answer);
    throw new HttpError(response.status, message);
  }
  return answer;
}

// ---- views -------------------------------------------------------------------------------------------------------

const COST = "What the run's training rows say it cost (no prices): tokens trained, and seconds its steps spent sampling, scoring and training";

function tokenCount(n) {
  return n < 1000 ? String(n) : n < 1e6 ? `${num(n / 1000, 1)}k` : `${num(n / 1e6, 2)}M`;
}

function cost(r) {
  const parts = [];
  if (r.tokens_trained !== null) parts.push(`${tokenCount(r.tokens_trained)} tokens trained`);
  if (r.step_seconds !== null) parts.push(`${duration(r.step_seconds)} in steps`);
  return parts.join(" · ") || "–";
}

async function runsView() {
  const runs = await api("/runs");
  return {
    data: runs,
    draw: () => [
      h("h1", {}, "Runs"),
      runs.length === 0
        ? h("p", { class: "muted" }, "No runs in this store yet: train a model (its history rows appear here).")
        : table(
            `${runs.length} run(s), the latest first`,
            ["Model", "Base model", "Project", "Status", "Step", "Best validation", "Wall time", "Cost", "Rows", "Updated", "Run id"],
            runs.map((r) =>
              h(
                "tr",
                { "data-run": r.run },
                h("td", {}, h("a", { href: `#/run/${runPath(r.project, r.name)}?run=${enc(r.run)}` }, r.name)),
                h("td", { class: "base-model" }, r.base_model ?? "–"),
                h("td", {}, r.project),
                h("td", {}, h("span", { class: `badge ${r.status}` }, r.status)),
                h("td", {}, r.last_step),
                h("td", {}, r.best_val_reward === null ? "–" : `${num(r.best_val_reward)} (step ${r.best_val_step})`),
                h("td", {}, duration(r.wall_seconds)),
                h("td", { class: "cost", title: COST }, cost(r)),
                h("td", {}, r.rows),
                h("td", {}, ago(r.updated)),
                h("td", { class: "muted" }, r.run.slice(0, 8) || "(none)"),
              ),
            ),
          ),
    ],
  };
}

// A run's curves, in sections as RL people read them. Each chart draws the series of its metrics that the rows
// have (a chart, and a section, with none is left out); every metric no chart names gets its own under "Other".
// A series ``{ name, of, label }`` is derived from a row's metrics (``of``) rather than read from them.
const perSecond = (m) => (m.tokens_trained != null && m.train_seconds > 0 ? m.tokens_trained / m.train_seconds : null);
const SECTIONS = [
  { id: "reward", title: "Reward", charts: [
    { id: "reward", title: "Reward (train mean, validation)", series: ["reward_mean", "val/reward", "drawn_reward_mean"], skipped: true },
    { id: "reward_std", title: "Reward spread within a step", series: ["reward_std"] },
  ] },
  { id: "policy", title: "Policy", charts: [
    { id: "loss", title: "Loss", series: ["loss"] },
    { id: "kl", title: "KL to the reference", series: ["kl"] },
    { id: "entropy", title: "Entropy", series: ["entropy"] },
    { id: "clip_fraction", title: "Clip fraction", series: ["clip_fraction"] },
    { id: "grad_norm", title: "Gradient norm", series: ["grad_norm"] },
  ] },
  { id: "importance", title: "Importance sampling: is the served policy the trained one?", charts: [
    { id: "is_ratio", title: "Importance ratio", series: ["is_ratio_mean", "is_ratio_max", "off_policy_is_ratio_mean"] },
    { id: "is_clipped", title: "Clipped share of tokens", series: ["is_clipped_fraction", "off_policy_is_clipped_fraction"] },
    { id: "logprob_gap", title: "Sampler/trainer log-prob gap", series: ["sampler_logprob_gap"] },
    { id: "gap_alarm", title: "Gap alarm (1: the gap jumped)", series: ["sampler_gap_alarm"] },
  ] },
  { id: "time", title: "Step time and throughput", charts: [
    { id: "seconds", title: "Seconds per step: sampling, scoring, training", series: ["rollout_seconds", "score_seconds", "train_seconds"] },
    { id: "tokens_per_second", title: "Tokens trained per second", series: [{ name: "tokens_per_second", of: perSecond, label: "tokens_trained / train_seconds" }] },
    { id: "tokens", title: "Tokens trained", series: ["tokens_trained", "tokens_without_sampler_logprobs"] },
  ] },
  { id: "sampling", title: "Dynamic sampling", charts: [
    { id: "groups", title: "Groups drawn, kept, dropped", series: ["groups_drawn", "groups_kept", "groups_dropped", "groups"] },
    { id: "zero_variance", title: "Zero-variance share", series: ["zero_variance_fraction"] },
  ] },
  { id: "staleness", title: "Staleness (off-policy members)", charts: [
    { id: "staleness", title: "Staleness", series: ["staleness", "off_policy_members"] },
    { id: "off_policy_tokens", title: "Off-policy tokens", series: ["off_policy_tokens"] },
  ] },
];
const SKIPPED = "skipped";
const SKIP_REASONS = { 1: "no group had reward variance", 2: "no optimizer step (a non-finite gradient)" };
const CONSUMED = new Set([SKIPPED, "skip_reason"]); // shown as the reward chart's markers and a count in the facts

// The steps of ``rows`` and one value per step of each series (the last row's of that step: train and validation
// rows of a step are one point on the x axis); a metric a step's rows lack is ``undefined`` (spanned over), a NaN
// is null (a gap). ``points``: the finite values of each series.
function seriesOf(chart, rows) {
  const steps = [...new Set(rows.map((r) => r.step))].sort((a, b) => a - b);
  const at = new Map(steps.map((s, i) => [s, i]));
  const out = [];
  for (const spec of chart.series) {
    const { name, of, label } = typeof spec === "string" ? { name: spec, of: null, label: spec } : spec;
    const ys = new Array(steps.length).fill(undefined);
    let seen = false;
    for (const r of rows) {
      const v = of ? of(r.metrics) : r.metrics[name];
      if (v === undefined || (of && v === null)) continue;
      ys[at.get(r.step)] = v;
      seen = true;
    }
    if (seen) out.push({ name, label, ys, points: ys.filter((y) => y !== null && y !== undefined).length });
  }
  return { steps, series: out };
}

function skippedSteps(rows) {
  return rows.filter((r) => r.metrics[SKIPPED] === 1).map((r) => ({ step: r.step, reason: SKIP_REASONS[r.metrics.skip_reason] ?? null }));
}

function chartFigure(chart, rows, skipped) {
  const { steps, series } = seriesOf(chart, rows);
  if (!series.length) return null;
  const marks = chart.skipped ? skipped : [];
  const last = (s) => s.ys.filter((y) => y !== null && y !== undefined).at(-1);
  const said = series.map((s) => `${s.label} ${s.points} points, last ${num(last(s), 4)}`);
  if (marks.length) said.push(`skipped steps ${marks.map((m) => m.step).join(", ")}`);
  const box = h(
    "figure",
    { class: "chart", tabindex: "0", "data-chart": chart.id, "data-skipped": marks.map((m) => m.step).join(",") || null, role: "img", "aria-label": `${chart.title}: ${said.join("; ")}` },
    h("h3", {}, chart.title),
    h(
      "ul",
      { class: "legend", "aria-hidden": "true" },
      series.map((s, i) => h("li", { "data-series": s.name, "data-points": s.points }, h("span", { class: `swatch s${i}` }), `${s.label} `, h("span", { class: "last" }, num(last(s), 4)))),
      marks.length ? h("li", { class: "skipped-mark", title: marks.map((m) => `step ${m.step}${m.reason ? `: ${m.reason}` : ""}`).join("; ") }, h("span", { class: "swatch skip" }), `skipped: step ${marks.map((m) => m.step).join(", ")}`) : null,
    ),
  );
  charts.push({ box, steps, series, marks: marks.map((m) => m.step) });
  return box;
}

function curves(rows) {
  const skipped = skippedSteps(rows);
  const named = new Set(SECTIONS.flatMap((s) => s.charts.flatMap((c) => c.series.map((x) => (typeof x === "string" ? x : null)))));
  const other = new Set();
  for (const row of rows) for (const k of Object.keys(row.metrics)) if (!named.has(k) && !CONSUMED.has(k)) other.add(k);
  const sections = [...SECTIONS, { id: "other", title: "Other", charts: [...other].sort().map((k) => ({ id: k, title: k, series: [k] })) }];
  return sections.map((section) => {
    const figures = section.charts.map((c) => chartFigure(c, rows, skipped)).filter(Boolean);
    return figures.length
      ? h("section", { class: "curves", "data-section": section.id, "aria-labelledby": `curves-${section.id}` }, h("h3", { id: `curves-${section.id}`, class: "section" }, section.title), h("div", { class: "charts" }, figures))
      : null;
  });
}

function drawCharts() {
  const style = getComputedStyle(document.documentElement);
  const color = (name) => style.getPropertyValue(name).trim();
  const fg = color("--muted");
  const grid = color("--line");
  const skip = color("--bad");
  for (const c of charts) {
    const width = Math.max(240, c.box.clientWidth - 16);
    const axis = { stroke: fg, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 } };
    const marks = (u) => {
      const ctx = u.ctx;
      ctx.save();
      ctx.strokeStyle = skip;
      ctx.setLineDash([4, 4]);
      ctx.lineWidth = 1.5 * devicePixelRatio;
      for (const step of c.marks) {
        const x = Math.round(u.valToPos(step, "x", true));
        ctx.beginPath();
        ctx.moveTo(x, u.bbox.top);
        ctx.lineTo(x, u.bbox.top + u.bbox.height);
        ctx.stroke();
      }
      ctx.restore();
    };
    new uPlot(
      {
        width,
        height: 170,
        legend: { show: false },
        cursor: { drag: { x: false, y: false } },
        scales: { x: { time: false } },
        axes: [{ ...axis, label: "step", labelSize: 18 }, { ...axis, size: 56 }],
        series: [{}, ...c.series.map((s, i) => {
          const stroke = color(`--s${i}`);
          return { label: s.label, stroke, width: 2, spanGaps: false, points: { show: true, size: 5, fill: stroke } };
        })],
        hooks: c.marks.length ? { draw: [marks] } : {},
      },
      [c.steps, ...c.series.map((s) => s.ys)],
      c.box,
    );
  }
}

async function runView(project, name, params) {
  const run = params.get("run");
  const query = run ? `?run=${enc(run)}` : "";
  const [history, checkpoints] = await Promise.all([
    api(`/runs/${runPath(project, name)}/history${query}`),
    api(`/runs/${runPath(project, name)}/checkpoints${query}`),
  ]);
  const r = history.run;
  const rows = history.rows;
  const skipped = skippedSteps(rows);
  return {
    data: { history, checkpoints },
    draw: () => [
      h("p", { class: "crumbs" }, h("a", { href: "#/runs" }, "Runs"), ` / ${project}`),
      h("h1", {}, name),
      h(
        "ul",
        { class: "facts" },
        h("li", {}, "status ", h("span", { class: `badge ${r.status}` }, r.status)),
        h("li", {}, "step ", h("strong", {}, r.last_step)),
        h("li", {}, "best validation ", h("strong", {}, r.best_val_reward === null ? "–" : `${num(r.best_val_reward)} at step ${r.best_val_step}`)),
        h("li", {}, "base model ", h("strong", {}, r.base_model ?? "–")),
        h("li", {}, "wall time ", h("strong", {}, duration(r.wall_seconds))),
        h("li", { title: COST }, "cost ", h("strong", {}, cost(r))),
        h("li", {}, "rows ", h("strong", {}, r.rows)),
        h("li", { title: skipped.map((m) => `step ${m.step}${m.reason ? `: ${m.reason}` : ""}`).join("; ") || null }, "skipped steps ", h("strong", { id: "skipped" }, skipped.length)),
        h("li", {}, h("a", { href: `#/run/${runPath(project, name)}/rollouts${query}` }, "Rollouts →")),
      ),
      h("h2", {}, "Curves"),
      rows.length ? curves(rows) : h("p", { class: "muted" }, "No rows yet."),
      h("h2", {}, "Checkpoints"),
      checkpoints.directory === null
        ? h("p", { class: "muted" }, "This run's directory is not under this dashboard's home: its checkpoints are elsewhere.")
        : table(
            `${checkpoints.checkpoints.length} checkpoint(s) in ${checkpoints.directory}`,
            ["Step", "Validation reward", "Best", "Gate (lift on held-out items)", "Deployed as"],
            checkpoints.checkpoints.map((c) =>
              h(
                "tr",
                { "data-step": c.step },
                h("td", {}, c.step),
                h("td", {}, num(c.val_reward)),
                h("td", {}, c.best ? h("span", { class: "badge best" }, "best") : ""),
                h("td", {}, c.gate ? [gateBadge(c.gate), " ", interval(c.gate.evidence.interval)] : ""),
                h("td", {}, c.deployed.map((d) => [deployedBadge(d), " "])),
              ),
            ),
          ),
    ],
  };
}

async function rolloutsView(project, name, params) {
  const run = params.get("run");
  const query = run ? `&run=${enc(run)}` : "";
  const steps = await api(`/runs/${runPath(project, name)}/rollouts${run ? `?run=${enc(run)}` : ""}`);
  return {
    data: steps,
    draw: () => [
      h("p", { class: "crumbs" }, h("a", { href: "#/runs" }, "Runs"), " / ", h("a", { href: `#/run/${runPath(project, name)}${run ? `?run=${enc(run)}` : ""}` }, name)),
      h("h1", {}, `Rollouts of ${name}`),
      steps.length === 0
        ? h("p", { class: "muted" }, "No trajectories saved yet.")
        : table(
            "Saved trajectories by split and step, the latest first",
            ["Split", "Step", "Trajectories", ""],
            [...steps].reverse().map((s) =>
              h(
                "tr",
                {},
                h("td", {}, s.split),
                h("td", {}, s.step),
                h("td", {}, s.trajectories),
                h("td", {}, h("a", { href: `#/run/${runPath(project, name)}/groups?split=${enc(s.split)}&step=${s.step}${query}` }, "groups →")),
              ),
            ),
          ),
    ],
  };
}

async function groupsView(project, name, params) {
  const split = params.get("split") ?? "train";
  const step = params.get("step") ?? "0";
  const run = params.get("run");
  const query = `split=${enc(split)}&step=${enc(step)}${run ? `&run=${enc(run)}` : ""}`;
  const groups = await api(`/runs/${runPath(project, name)}/groups?${query}`);
  return {
    data: groups,
    draw: () => [
      h("p", { class: "crumbs" }, h("a", { href: "#/runs" }, "Runs"), " / ", h("a", { href: `#/run/${runPath(project, name)}${run ? `?run=${enc(run)}` : ""}` }, name), " / ", h("a", { href: `#/run/${runPath(project, name)}/rollouts${run ? `?run=${enc(run)}` : ""}` }, "rollouts")),
      h("h1", {}, `Step ${step} · ${split} · ${groups.length} group(s)`),
      h(
        "div",
        { class: "groups" },
        groups.map((g) =>
          h(
            "section",
            { class: "group", "data-group": g.index },
            h("h3", {}, `Group ${g.index + 1}: `, h("span", { class: "muted" }, g.prompt)),
            h("p", { class: "muted" }, `${g.members.length} trajectories · mean reward ${num(g.reward_mean)} · spread ${num(g.reward_spread)} · `, h("a", { href: `#/run/${runPath(project, name)}/group?${query}&index=${g.index}` }, "side by side →")),
            h(
              "ol",
              { class: "ranking" },
              g.members.map((m) => h("li", { "data-reward": m.reward }, h("a", { href: `#/trajectory/${m.id}` }, `reward ${num(m.reward)}`), " ", h("span", { class: "muted" }, m.tool_calls ? `${m.tool_calls} tool call(s) · ` : "", m.answer))),
            ),
          ),
        ),
      ),
    ],
  };
}

// Tokens coloured by the probability the sampler drew them with: from sure (uncoloured) to a guess.
const CONFIDENCE = [
  [0.9, "p ≥ 0.9"],
  [0.5, "0.5 ≤ p < 0.9"],
  [0.2, "0.2 ≤ p < 0.5"],
  [0.05, "0.05 ≤ p < 0.2"],
  [0, "p < 0.05"],
];
const RETOKENIZED = "Given as text, not as the tokens sampled: trained on as context, tokenized again from its text (an edited reply, or one whose call was never recorded)";

function confidence(logprob) {
  const p = Math.exp(logprob);
  return CONFIDENCE.findIndex(([low]) => p >= low);
}

function tokens(m) {
  return h(
    "pre",
    { class: "tokens" },
    m.tokens.map((t) =>
      t.logprob === null
        ? h("span", { class: "tok", title: "no log-prob (not finite)" }, t.text)
        : h("span", { class: `tok lp${confidence(t.logprob)}`, "data-logprob": t.logprob, title: `${JSON.stringify(t.text)}: log-prob ${num(t.logprob, 4)}, p ${num(Math.exp(t.logprob), 3)}` }, t.text),
    ),
  );
}

function confidenceLegend() {
  return h("ul", { class: "legend tokens-legend", "aria-label": "Token colours: the probability the sampler drew each token with" }, CONFIDENCE.map(([, label], i) => h("li", {}, h("span", { class: `tok lp${i}` }, label))));
}

// A trajectory's messages as a chat; ``colour``: its sampled turns' tokens coloured by their log-probs.
function chat(t, colour = false) {
  return h(
    "div",
    { class: "chat" },
    t.messages.map((m) =>
      h(
        "article",
        { class: `msg ${m.role}` },
        h("div", { class: "role" }, m.role, m.sampled ? " · sampled" : "", m.reward !== null ? ` · turn reward ${num(m.reward)}` : "", m.tool_call_id ? ` · result of ${m.tool_call_id}` : "", m.retokenized ? [" ", h("span", { class: "badge retokenized", title: RETOKENIZED }, "retokenized")] : null),
        colour && m.tokens ? tokens(m) : m.content ? h("pre", {}, m.content) : null,
        colour && m.sampled && !m.tokens ? h("p", { class: "muted no-logprobs" }, "No per-token log-probs were saved for this turn (its request did not ask for them, or the gateway redacted the call).") : null,
        m.tool_calls.map((c) => h("div", { class: "call", "data-tool": c.name }, `→ ${c.name}(${c.arguments})`)),
      ),
    ),
  );
}

function colourToggle(t) {
  if (!t.messages.some((m) => m.sampled)) return null;
  if (!t.messages.some((m) => m.tokens)) return h("p", { class: "muted", id: "no-logprobs" }, "No sampled turn of this trajectory saved per-token log-probs (its requests did not ask for logprobs, or the gateway redacted its calls), so there are none to colour.");
  return [
    h(
      "p",
      {},
      h("label", {}, h("input", { type: "checkbox", id: "by-logprob", checked: byLogprob, onchange: (event) => {
        byLogprob = event.target.checked;
        sessionStorage.setItem(BY_LOGPROB, byLogprob ? "1" : "");
        refresh(true, false);
      } }), " Colour sampled tokens by their log-prob (hover a token for its value)"),
    ),
    byLogprob ? confidenceLegend() : null,
  ];
}

function scores(t) {
  return [
    Object.keys(t.graders).length
      ? table("Graders", ["Grader", "Score"], Object.entries(t.graders).map(([k, v]) => h("tr", {}, h("td", {}, k), h("td", {}, num(v)))))
      : null,
    t.judge.length ? h("div", { class: "judge" }, h("h3", {}, "Judge"), t.judge.map((line) => h("p", {}, line))) : null,
  ];
}

async function groupView(project, name, params) {
  const run = params.get("run");
  const query = `split=${enc(params.get("split") ?? "train")}&step=${enc(params.get("step") ?? "0")}${run ? `&run=${enc(run)}` : ""}`;
  const group = await api(`/runs/${runPath(project, name)}/groups/${enc(params.get("index") ?? "0")}?${query}`);
  return {
    data: group,
    draw: () => [
      h("p", { class: "crumbs" }, h("a", { href: "#/runs" }, "Runs"), " / ", h("a", { href: `#/run/${runPath(project, name)}${run ? `?run=${enc(run)}` : ""}` }, name), " / ", h("a", { href: `#/run/${runPath(project, name)}/groups?${query}` }, `step ${group.step}`)),
      h("h1", {}, `Group ${group.index + 1} of step ${group.step} (${group.split}), ranked by reward`),
      h(
        "div",
        { class: "side" },
        group.members.map((t, i) =>
          h("section", { "data-rank": i + 1 }, h("h3", {}, `#${i + 1} · reward ${num(t.reward)} · `, h("a", { href: `#/trajectory/${t.id}` }, "open")), scores(t), chat(t)),
        ),
      ),
    ],
  };
}

async function trajectoryView(id) {
  const t = await api(`/trajectories/${enc(id)}`);
  const retokenized = t.messages.filter((m) => m.retokenized).length;
  const runLink = `#/run/${runPath(t.project, t.name)}?run=${enc(t.run)}`;
  return {
    data: t,
    draw: () => [
      h("p", { class: "crumbs" }, h("a", { href: "#/runs" }, "Runs"), " / ", h("a", { href: runLink }, t.name), " / ", h("a", { href: `#/run/${runPath(t.project, t.name)}/groups?split=${enc(t.split)}&step=${t.step}&run=${enc(t.run)}` }, `step ${t.step}`)),
      h("h1", {}, `Trajectory ${t.id}`),
      h(
        "ul",
        { class: "facts" },
        h("li", {}, "reward ", h("strong", { id: "reward" }, num(t.reward, 4))),
        h("li", {}, "split ", h("strong", {}, t.split)),
        h("li", {}, "step ", h("strong", {}, t.step)),
        t.branch ? h("li", {}, "abandoned branch ", h("strong", {}, t.branch)) : null,
        t.tools.length ? h("li", {}, "tools ", h("strong", {}, t.tools.join(", "))) : null,
        retokenized ? h("li", { title: RETOKENIZED }, "retokenized turns ", h("strong", { id: "retokenized" }, retokenized)) : null,
      ),
      scores(t),
      h("h2", {}, "Chat"),
      colourToggle(t),
      chat(t, byLogprob),
      Object.keys(t.metrics).length
        ? [h("h2", {}, "Metrics"), table("", ["Metric", "Value"], Object.entries(t.metrics).map(([k, v]) => h("tr", {}, h("td", {}, k), h("td", {}, num(v, 4)))))]
        : null,
      Object.keys(t.metadata).length
        ? [h("h2", {}, "Metadata"), table("", ["Key", "Value"], Object.entries(t.metadata).map(([k, v]) => h("tr", {}, h("td", {}, k), h("td", { class: "wrap" }, JSON.stringify(v)))))]
        : null,
      t.logs.length ? [h("h2", {}, "Logs"), h("pre", {}, t.logs.join("\n"))] : null,
    ],
  };
}

// ---- the loop ----------------------------------------------------------------------------------------------------

const signed = (v) => (v === null || v === undefined ? "–" : `${v >= 0 ? "+" : ""}${Number(v).toFixed(3)}`);
const share = (v) => (v === null || v === undefined ? "all traffic" : `${num(v * 100, 1)}% of episodes`);
const when = (iso) => new Date(iso).toLocaleString();

function interval(i) {
  if (!i) return "";
  const level = i.level === null ? "" : ` at level ${num(i.level, 4)}`;
  return h("span", { class: "interval" }, `${signed(i.mean)} [${signed(i.low)}, ${signed(i.high)}]${level}`);
}

function gateBadge(event) {
  const passed = event.action === "gate.pass";
  return h("a", { href: `#/event/${event.id}`, class: `badge ${passed ? "pass" : "hold"}`, title: event.reason ?? "" }, passed ? "passed" : "held");
}

function deployedBadge(d) {
  return h("span", { class: "badge deployed", title: `since ${when(d.updated_at)} (${d.updated_by})` }, d.share === null ? d.name : `${d.name} · ${num(d.share * 100, 1)}%`);
}

function evidence(e) {
  const ev = e.evidence;
  const parts = [];
  if (e.kind === "gate") parts.push(["lift ", interval(ev.interval)]);
  if (e.kind === "canary") parts.push(["canary − production ", interval(ev.interval)]);
  if (e.kind === "shadow" && ev.interval) parts.push(["shadow − production ", interval(ev.interval)]);
  if (ev.confirmation) parts.push(["confirmed ", interval(ev.confirmation)]);
  if (ev.look !== null && e.kind === "gate") parts.push(`look ${ev.look}`);
  if (ev.canary_episodes !== null) parts.push(`${ev.canary_episodes} canary / ${ev.production_episodes} production episodes`);
  if (ev.pairs !== null) parts.push(`${ev.pairs} pair(s)`);
  if (ev.unsafe) parts.push(h("span", { class: "error" }, `${ev.unsafe} unsafe`));
  if (ev.failed.length) parts.push(h("span", { class: "error" }, `failed: ${ev.failed.join(", ")}`));
  if (e.kind === "deployment" || e.kind === "rewind") parts.push(`step ${ev.step ?? "–"}`);
  if (e.kind === "deployment" && e.action !== "remove") parts.push(share(ev.share));
  if (ev.events.length) parts.push(["after ", ev.events.map((i, n) => [n ? ", " : "", h("a", { href: `#/event/${i}` }, `event ${i}`)])]);
  return parts.flatMap((p, n) => (n ? [" · ", p] : [p]));
}

function pager(params, key, page, label) {
  const at = (offset) => {
    const next = new URLSearchParams(params);
    next.set(key, offset);
    return `#/loop?${next}`;
  };
  return h(
    "nav",
    { class: "pager", "aria-label": `${label} pages` },
    h("span", { class: "muted" }, page.total ? `${page.offset + 1}–${page.offset + page.items.length} of ${page.total}` : "none"),
    page.offset > 0 ? h("a", { class: "button", href: at(Math.max(0, page.offset - PAGE)) }, "← Newer") : null,
    page.next_offset !== null ? h("a", { class: "button", href: at(page.next_offset) }, "Older →") : null,
  );
}

function estimate(e) {
  if (e.value === null) return "–";
  return e.low === null ? num(e.value) : `${num(e.value)} [${num(e.low)}, ${num(e.high)}]`;
}

async function loopView(params) {
  const model = params.get("model");
  const only = model ? `model=${enc(model)}&` : "";
  const offset = (key) => Math.max(0, Number.parseInt(params.get(key) ?? "0", 10) || 0);
  const [deployed, timeline, trail, episodes, review] = await Promise.all([
    api(`/loop/deployments?${only}`),
    api(`/loop/timeline?${only}offset=${offset("timeline")}`),
    api(`/loop/audit?offset=${offset("audit")}`),
    api(`/loop/episodes?offset=${offset("episodes")}`),
    api("/loop/reviews"),
  ]);
  const verified = trail.verification;
  return {
    data: { deployed, timeline, trail, episodes, review },
    draw: () => [
      h("h1", {}, model ? `The loop of ${model}` : "The loop"),
      timeline.models.length
        ? h("p", { class: "crumbs" }, "Model: ", [null, ...timeline.models].map((m) => [h("a", { href: m ? `#/loop?model=${enc(m)}` : "#/loop", "aria-current": m === model ? "page" : null }, m ?? "all"), " "]))
        : null,
      h("h2", { id: "deployments" }, "Deployments"),
      deployed.length === 0
        ? h("p", { class: "muted" }, "Nothing is deployed yet: a candidate that passes the gate is (or `flywheel deploy`).")
        : table(
            "What each deployment serves",
            ["Deployment", "Serves", "Stage", "Traffic", "Updated", "By", "Event"],
            deployed.map((d) =>
              h(
                "tr",
                { "data-deployment": d.name },
                h("td", {}, h("strong", {}, d.name)),
                h("td", {}, d.serves),
                h("td", {}, h("span", { class: `badge stage-${d.stage}` }, d.stage)),
                h("td", {}, share(d.share)),
                h("td", { title: when(d.updated_at) }, ago(Date.parse(d.updated_at) / 1000)),
                h("td", {}, d.updated_by),
                h("td", {}, h("a", { href: `#/event/${d.event_id}` }, d.event_id)),
              ),
            ),
          ),
      h("h2", { id: "timeline" }, "Promotion timeline"),
      timeline.items.length === 0
        ? h("p", { class: "muted" }, "No gate decision, verdict or deployment recorded yet.")
        : h(
            "ol",
            { class: "timeline", reversed: true },
            timeline.items.map((e) =>
              h(
                "li",
                { class: `kind-${e.kind}`, "data-action": e.action, "data-event": e.id },
                h("div", { class: "what" }, h("span", { class: `badge ${e.action.replace(".", "-")}` }, e.action), " ", h("strong", {}, e.subject), " ", h("span", { class: "muted" }, `${when(e.at)} · ${e.actor} · `, h("a", { href: `#/event/${e.id}` }, `event ${e.id}`))),
                h("div", { class: "evidence" }, evidence(e)),
                e.reason ? h("p", { class: "reason" }, e.reason) : null,
              ),
            ),
          ),
      timeline.total ? pager(params, "timeline", timeline, "Timeline") : null,
      h("h2", { id: "audit" }, "Audit trail"),
      h(
        "p",
        { id: "audit-status", class: verified.ok ? "verified" : "error", "data-ok": String(verified.ok) },
        h("span", { class: `badge ${verified.ok ? "pass" : "hold"}` }, verified.ok ? "verified" : "NOT verified"),
        " ",
        verified.message,
      ),
      table(
        "Every event, the latest first",
        ["Event", "When", "Actor", "Action", "Subject", "Signed", "Reason"],
        trail.items.map((e) =>
          h(
            "tr",
            { id: `event-${e.id}`, class: verified.bad_id === e.id ? "bad" : null },
            h("td", {}, h("a", { href: `#/event/${e.id}` }, e.id)),
            h("td", {}, when(e.at)),
            h("td", {}, e.actor),
            h("td", {}, e.action),
            h("td", {}, e.subject),
            h("td", {}, e.signed ? "MAC" : "–"),
            h("td", { class: "wrap" }, e.reason ?? ""),
          ),
        ),
      ),
      pager(params, "audit", trail, "Audit trail"),
      h("h2", { id: "episodes" }, "Production episodes"),
      episodes.items.length === 0
        ? h("p", { class: "muted" }, `No episodes of split '${episodes.split}' yet.`)
        : table(
            `Episodes of split '${episodes.split}' with their grades, the latest first`,
            ["Episode", "Task", "Status", "Reward", "Answered by", "Grades", "Review label", "Created"],
            episodes.items.map((e) =>
              h(
                "tr",
                { "data-episode": e.id },
                h("td", { title: e.id }, e.id.slice(0, 14)),
                h("td", {}, e.task_id),
                h("td", {}, e.status),
                h("td", {}, num(e.reward)),
                h("td", {}, e.arm ?? "–"),
                h("td", {}, e.grades.map((g) => h("span", { class: "grade", title: `${g.grader} (${g.version})` }, `${g.component} ${num(g.score)} `))),
                h("td", {}, num(e.label)),
                h("td", {}, ago(Date.parse(e.created_at) / 1000)),
              ),
            ),
          ),
      episodes.total ? pager(params, "episodes", episodes, "Episodes") : null,
      h("h2", { id: "reviews" }, "Human review: graders' agreement with the labels"),
      h("p", { class: "muted" }, `${review.queued} episode(s) queued for review, ${review.labelled} labelled.`),
      review.graders.length === 0
        ? h("p", { class: "muted" }, "No labelled episode yet (`flywheel review sample`, then `flywheel review label`).")
        : table(
            "Per grader and stack version; intervals are 95%",
            ["Grader", "Component", "Stack version", "Labels", "Agreement", "Precision", "Recall", "Kappa", "Correlation"],
            review.graders.map((g) =>
              h(
                "tr",
                { "data-grader": g.grader },
                h("td", {}, g.grader),
                h("td", {}, g.component),
                h("td", { title: g.version }, `${g.stack} ${g.version.slice(0, 8)}`),
                h("td", {}, g.n),
                h("td", {}, estimate(g.agreement)),
                h("td", {}, estimate(g.precision)),
                h("td", {}, estimate(g.recall)),
                h("td", {}, estimate(g.kappa)),
                h("td", {}, estimate(g.correlation)),
              ),
            ),
          ),
    ],
  };
}

async function eventView(id) {
  const e = await api(`/loop/audit/${enc(id)}`);
  return {
    data: e,
    draw: () => [
      h("p", { class: "crumbs" }, h("a", { href: "#/loop" }, "The loop"), " / audit trail"),
      h("h1", {}, `Audit event ${e.id}: ${e.action}`),
      h(
        "ul",
        { class: "facts" },
        h("li", {}, "subject ", h("strong", {}, e.subject)),
        h("li", {}, "actor ", h("strong", {}, e.actor)),
        h("li", {}, "when ", h("strong", {}, when(e.at))),
        h("li", {}, e.signed ? "signed (MAC)" : "not signed"),
      ),
      e.reason ? h("p", { class: "reason" }, e.reason) : null,
      h("h2", {}, "Details"),
      h("pre", { class: "details" }, JSON.stringify(e.details, null, 2)),
      h("p", { class: "muted" }, `hash ${e.hash}`),
    ],
  };
}

function pretty(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

// One waiting call: what the model wants to do, and the two decisions.
function approvalCard(a) {
  const decide = async (form, decision) => {
    const reviewer = document.getElementById("reviewer");
    const status = form.querySelector(".status");
    if (!reviewer.value.trim()) {
      status.textContent = "Say who decides first (above).";
      reviewer.focus();
      return;
    }
    try {
      await api(`/approvals/${a.id}/${decision}`, { by: reviewer.value.trim(), reason: form.elements.reason.value || null });
      refresh(true, false);
    } catch (error) {
      status.textContent = error.message;
    }
  };
  return h(
    "section",
    { class: "approval", "data-approval": a.id, "aria-labelledby": `approval-${a.id}` },
    h("h3", { id: `approval-${a.id}` }, `#${a.id} `, h("code", {}, a.tool), a.deployment ? ` · ${a.deployment}` : ""),
    h("pre", { class: "details" }, pretty(a.arguments)),
    h("p", { class: "muted" }, `episode ${a.episode_id ?? "–"} · ${a.split ?? "no split"} · asked ${ago(Date.parse(a.requested_at) / 1000)} · denied unless decided by ${when(a.deadline)}`),
    h(
      "form",
      { onsubmit: (event) => { event.preventDefault(); decide(event.target, event.submitter?.value ?? "approve"); } },
      h("label", { for: `reason-${a.id}` }, "Reason "),
      h("input", { id: `reason-${a.id}`, name: "reason", maxlength: 2000, size: 32 }),
      " ",
      h("button", { type: "submit", value: "approve", class: "approve" }, "Approve"),
      " ",
      h("button", { type: "submit", value: "deny", class: "deny" }, "Deny"),
      " ",
      h("span", { class: "status error", role: "status" }),
    ),
  );
}

async function approvalsView() {
  const a = await api("/approvals");
  return {
    data: a,
    draw: () => [
      h("h1", {}, "Approvals"),
      h("p", { class: "muted" }, "In production a call of a high-impact tool waits here for a person; one nobody decides by its deadline is denied. The agent is told the decision."),
      h(
        "p",
        {},
        h("label", { for: "reviewer" }, "Deciding as "),
        h("input", { id: "reviewer", name: "reviewer", autocomplete: "name", value: localStorage.getItem(REVIEWER) ?? "", oninput: (event) => {
          localStorage.setItem(REVIEWER, event.target.value);
          for (const status of document.querySelectorAll(".approval .status")) status.textContent = ""; // asked and answered
        } }),
      ),
      h("h2", {}, `Waiting (${a.pending.length})`),
      a.pending.length ? a.pending.map(approvalCard) : h("p", { class: "muted" }, "Nothing waits for a decision."),
      h("h2", {}, "Decided lately"),
      a.recent.length
        ? table("The latest decisions, newest first", ["#", "tool", "deployment", "decision", "by", "reason", "when"], a.recent.map((r) => h("tr", { "data-approval": r.id },
            h("td", {}, r.id), h("td", {}, h("code", {}, r.tool)), h("td", {}, r.deployment ?? "–"),
            h("td", {}, h("span", { class: `badge ${r.status}` }, r.status)), h("td", {}, r.decided_by ?? "–"),
            h("td", {}, r.reason ?? ""), h("td", {}, r.decided_at ? when(r.decided_at) : "–"))))
        : h("p", { class: "muted" }, "No decision yet."),
      h("h2", {}, "Tool policies"),
      a.policies.length
        ? table("Each deployment's tools", ["deployment", "may call", "high-impact", "timeout", "off production"], a.policies.map((p) => h("tr", {},
            h("td", {}, p.deployment), h("td", {}, p.allowed ? p.allowed.join(", ") : "any tool"), h("td", {}, p.high_impact.join(", ") || "–"),
            h("td", {}, duration(p.timeout_s)), h("td", {}, p.otherwise))))
        : h("p", { class: "muted" }, "No tool policies: every deployment may call any tool, and none needs approval (flywheel approvals policy)."),
    ],
  };
}

function keyForm(message) {
  return [
    h("h1", {}, "An admin key is needed"),
    h("p", { class: "muted" }, message),
    h(
      "form",
      {
        onsubmit: (event) => {
          event.preventDefault();
          sessionStorage.setItem(KEY, event.target.elements.key.value);
          refresh(true);
        },
      },
      h("label", { for: "key" }, "API key (admin) "),
      h("input", { id: "key", name: "key", type: "password", autocomplete: "off", required: true }),
      " ",
      h("button", { type: "submit" }, "Use it"),
    ),
  ];
}

// ---- routing -----------------------------------------------------------------------------------------------------

function route() {
  const [path, search] = (location.hash.slice(1) || "/runs").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  const params = new URLSearchParams(search ?? "");
  if (parts[0] === "run" && parts.length >= 3) {
    const [, project, name, sub] = parts;
    if (sub === "rollouts") return () => rolloutsView(project, name, params);
    if (sub === "groups") return () => groupsView(project, name, params);
    if (sub === "group") return () => groupView(project, name, params);
    return () => runView(project, name, params);
  }
  if (parts[0] === "trajectory" && parts[1]) return () => trajectoryView(parts[1]);
  if (parts[0] === "loop") return () => loopView(params);
  if (parts[0] === "event" && parts[1]) return () => eventView(parts[1]);
  if (parts[0] === "approvals") return approvalsView;
  return runsView;
}

let refreshing = false;
let again = null; // a refresh asked for while one ran: { redraw, top }

// Fetch the view's data and draw it if it changed (or if ``redraw``); ``top``: a new view, scrolled to its top.
async function refresh(redraw = false, top = redraw) {
  if (refreshing) {
    again = { redraw: redraw || again?.redraw, top: top || again?.top };
    return;
  }
  refreshing = true;
  try {
    const { data, draw } = await route()();
    const text = JSON.stringify(data);
    if (redraw || text !== shown) {
      shown = text;
      const scroll = top ? 0 : window.scrollY;
      charts = [];
      view.replaceChildren(...draw().flat(Infinity).filter(Boolean));
      drawCharts();
      window.scrollTo(0, scroll);
      if (top) view.focus({ preventScroll: true });
    }
    live.textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    shown = "";
    const denied = error instanceof HttpError && (error.status === 401 || error.status === 403);
    const title = error instanceof HttpError && error.status === 404 ? "Not found" : "Could not load this view";
    view.replaceChildren(...(denied ? keyForm(error.message) : [h("h1", {}, title), h("p", { class: "error" }, error.message)]));
  } finally {
    refreshing = false;
    if (again) {
      const next = again;
      again = null;
      refresh(next.redraw, next.top);
    }
  }
}

window.addEventListener("hashchange", () => refresh(true));
setInterval(() => document.visibilityState === "visible" && refresh(), POLL_MS);
let resized; // charts are drawn to their box's width and in the scheme's colours: again when either changes
const redraw = () => {
  clearTimeout(resized);
  resized = setTimeout(() => refresh(true, false), 200);
};
window.addEventListener("resize", redraw);
matchMedia("(prefers-color-scheme: dark)").addEventListener("change", redraw);
refresh(true);
