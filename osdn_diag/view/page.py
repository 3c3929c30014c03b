"""The view as one self-contained HTML page: :func:`render` and :class:`View`.

Everything is inline — plotly.js (plotly's own offline bundle, ~4.8 MB), the figures' JSON, the
runs' data and the page's script — so the file opens from disk in any browser with no network.
The data a figure or strip shows is in a ``<script type="application/json" id="osdn-view-data">``
block: per run the head curves (``"L.H"``: q_geo and n per position bin) and the token strips, each
strip's per-token values as base64 of little-endian float32 ``[L + 1, T]`` arrays (row ``L``: every
layer pooled; see :class:`~osdn_diag.view.data.StripPrompt`). The figures are in
``<script type="application/json" id="osdn-view-figures">``.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from pathlib import Path

from .data import STRIP_FIELDS, RunView, view_data
from .figures import FIGURES, run_colour

__all__ = ["View", "render", "write_view"]


def _b64(a) -> str:
    import numpy as np

    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode("ascii")


def _g(x, fmt: str = ".4g") -> str:
    return "–" if x is None else format(x, fmt)


def _yes(x) -> str:
    return "–" if x is None else ("yes" if x else "no")


def _fidelity(s: dict) -> str:
    if s.get("counterfactual"):
        return "counterfactual (what-if): nothing to check against"
    f = s.get("fidelity") or {}
    if f.get("max_rel_error") is None:
        return "not measured (reference kernels replayed)"
    text = f"{f['max_rel_error']:.2e} max relative error of the output"
    state = f.get("state") or {}
    if state.get("max_rel_error") is not None:
        text += f"; final state {state['max_rel_error']:.2e}"
    return text


def _summary_table(runs: list[RunView]) -> str:
    """The runs' headline numbers, fidelity and assumption audit (summary.json), one row per run."""
    head = ["run", "q_geo", "q_arith", "n", "fidelity", "unit keys", "β ∈ (0, 1)", "d in box", "decay",
            "β < 1/d_max", "Theorem D.7 hypotheses", "prompts", "layers × heads"]
    rows = []
    for i, r in enumerate(runs):
        s, a = r.summary, r.summary.get("assumptions") or {}
        share = a.get("share_newton_infeasible")
        rows.append([f'<span class="swatch" style="background:{run_colour(i)}"></span>{html.escape(r.label)}',
                     _g(s.get("q_geo")), _g(s.get("q_arith")), f"{s.get('n', 0):,}", html.escape(_fidelity(s)),
                     _yes(a.get("unit_keys")), _yes(a.get("beta_in_open_unit_interval")), _yes(a.get("d_in_box")),
                     _yes(a.get("decay")), "–" if share is None else f"{100 * share:.1f} %",
                     _yes(a.get("theorem_d7_hypotheses_hold")), str(len(r.prompts)),
                     f"{len(r.layers)} × {r.heads}"])
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return ('<table class="summary"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head)
            + f"</tr></thead><tbody>{body}</tbody></table>")


def _data(runs: list[RunView]) -> dict:
    out = []
    for i, r in enumerate(runs):
        out.append({
            "label": r.label, "colour": run_colour(i), "layers": r.layers, "heads": r.heads, "note": r.note,
            "head_curves": {f"{lay}.{h}": {"q_geo": q, "n": n} for (lay, h), (q, n) in sorted(r.head_curves.items())},
            "prompts": len(r.prompts),
            "strips": [{"id": p.id, "task": p.task, "length": p.length, "tokens": p.tokens, "token_ids": p.token_ids,
                        "values": {f: _b64(p.values[f]) for f in STRIP_FIELDS}} for p in r.strips],
        })
    return {"runs": out, "fields": list(STRIP_FIELDS)}


def _strip_note(runs: list[RunView]) -> str:
    ids = sorted({p.id for r in runs for p in r.strips})
    total = max((len(r.prompts) for r in runs), default=0)
    if not ids:
        return "No token strips (none asked for)."
    return (f"Token strips for {len(ids)} of {total} prompts (ids {', '.join(map(str, ids))}); every other "
            "panel is over every prompt. Choose others with --strips N or --strip-prompts ID,ID,…")


def _finite(obj):
    """``obj`` with every NaN or infinity replaced by ``None`` (a gap in a figure): the page's JSON
    is strict, as every JSON file the package writes."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _json_script(id_: str, obj) -> str:
    text = json.dumps(obj, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    return f'<script type="application/json" id="{id_}">{text}</script>'


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:16px 24px;color:#222}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:22px 0 6px}
.note{color:#555;font-size:13px;margin:4px 0 10px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(520px,1fr));gap:12px}
.panel{border:1px solid #e3e3e3;border-radius:6px;padding:6px;min-height:120px}
table.summary{border-collapse:collapse;font-size:13px} table.summary td,table.summary th{border:1px solid #ddd;
padding:3px 8px;text-align:right} table.summary td:first-child{text-align:left}
.swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:6px}
.controls{font-size:13px;margin:6px 0} .controls select{margin:0 12px 0 4px}
.strip{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;line-height:1.9;white-space:pre-wrap;
word-break:break-all;border-left:4px solid #ccc;padding:2px 8px;margin:4px 0}
.strip span{padding:1px 0;border-radius:2px;cursor:default} .strip span.sel{outline:2px solid #000}
.striplabel{font-size:12px;font-weight:600;margin-top:8px}
#strip-info{font-size:12px;font-family:ui-monospace,Menlo,monospace;background:#f5f5f5;padding:4px 8px;min-height:18px}
#strip-scale{height:12px;width:320px;display:inline-block;vertical-align:middle;margin:0 6px}
"""

# First of all: any error of the page's scripts is also shown on the page (a reader sees that a panel
# failed, not just an empty box) and counted in <html data-errors>, which the browser test reads.
_ERRORS_JS = r"""
(function(){
  let n = 0;
  function show(msg){ n += 1; document.documentElement.setAttribute('data-errors', String(n));
    const add = () => { let el = document.getElementById('osdn-view-errors');
      if (!el) { el = document.createElement('pre'); el.id = 'osdn-view-errors';
        el.style.cssText = 'color:#b00;background:#fee;padding:6px;white-space:pre-wrap';
        document.body.insertBefore(el, document.body.firstChild); }
      el.textContent += 'view error: ' + msg + '\n'; };
    if (document.body) add(); else document.addEventListener('DOMContentLoaded', add); }
  window.addEventListener('error', e => show(e.message || String(e)));
  window.addEventListener('unhandledrejection', e => show(String(e.reason)));
  const err = console.error.bind(console);
  console.error = function(...a){ show(a.map(String).join(' ')); err(...a); };
})();
"""

# The page's own script: draws the figures, links the heat map to the head curve, and renders the
# token strips from the base64 arrays (colour: log10 q_t on one scale over the runs shown).
_JS = r"""
(function(){
const DATA = JSON.parse(document.getElementById('osdn-view-data').textContent);
const FIGS = JSON.parse(document.getElementById('osdn-view-figures').textContent);
const cfg = {displaylogo:false, responsive:true};
for (const [id, fig] of Object.entries(FIGS)) {
  const el = document.getElementById(id);
  if (el && fig) Plotly.newPlot(el, fig.data, fig.layout, cfg);
}
function f32(b64){const s=atob(b64);const u=new Uint8Array(s.length);for(let i=0;i<s.length;i++)u[i]=s.charCodeAt(i);
  return new Float32Array(u.buffer);}
for (const r of DATA.runs) for (const p of r.strips) { p.v = {}; for (const f of DATA.fields) p.v[f] = f32(p.values[f]); }
// heat map -> head curve: a click on a cell, or the address's #head=LAYER.HEAD (a link to a head)
const hm = document.getElementById('layer-head'), hc = document.getElementById('head-curve');
function showHead(layer, head){
  const key = layer + '.' + head;
  const edges = [...Array(11).keys()].map(b => b/10), x = edges.slice(0,-1).map((a,i)=>(a+edges[i+1])/2);
  const traces = [];
  DATA.runs.forEach(r => { const c = r.head_curves[key]; if (!c) return;
    traces.push({type:'scatter', mode:'lines+markers', x:x, y:c.q_geo, name:r.label, line:{color:r.colour},
      customdata:c.n.map((n,i)=>[n,'['+edges[i].toFixed(2)+', '+edges[i+1].toFixed(2)+')']),
      hovertemplate:'%{fullData.name}<br>bin %{customdata[1]}<br>q_geo %{y:.4g}<br>n %{customdata[0]:,}<extra></extra>'}); });
  if (!traces.length || !hc) return;
  const layout = Object.assign({}, hc.layout, {title:{text:'Layer '+layer+', head '+head+': q_geo by relative position', x:0.01, font:{size:14}}});
  Plotly.react(hc, traces, layout, cfg);
}
if (hm && hm.on) hm.on('plotly_click', ev => { const pt = ev.points[0]; showHead(pt.y, pt.x);
  try { history.replaceState(null, '', '#head=' + pt.y + '.' + pt.x); } catch (e) {} });
const asked = /head=(\d+)\.(\d+)/.exec(location.hash);
if (asked) showHead(+asked[1], +asked[2]);
// token strips
const VIR = [[68,1,84],[59,82,139],[33,145,140],[94,201,98],[253,231,37]];
function colour(t){t=Math.min(1,Math.max(0,t));const k=t*(VIR.length-1),i=Math.min(VIR.length-2,Math.floor(k)),f=k-i;
  const c=VIR[i].map((a,j)=>Math.round(a+(VIR[i+1][j]-a)*f));return 'rgb('+c.join(',')+')';}
const promptSel = document.getElementById('strip-prompt'), layerSel = document.getElementById('strip-layer');
const box = document.getElementById('strips'), info = document.getElementById('strip-info');
const ids = [...new Set(DATA.runs.flatMap(r => r.strips.map(p => p.id)))].sort((a,b)=>a-b);
const layers = [...new Set(DATA.runs.flatMap(r => r.layers))].sort((a,b)=>a-b);
if (promptSel) { ids.forEach(id => { const p = DATA.runs.flatMap(r=>r.strips).find(s=>s.id===id);
    promptSel.add(new Option('prompt '+id+(p.task?' · '+p.task:'')+' ('+p.length+' tokens)', id)); });
  layerSel.add(new Option('every layer (pooled)', 'all')); layers.forEach(l => layerSel.add(new Option('layer '+l, l))); }
function fmt(x){return Number.isFinite(x)?(Math.abs(x)<1e-3||Math.abs(x)>=1e4?x.toExponential(3):x.toPrecision(4)):'–';}
function draw(){
  if (!box || !ids.length) return;
  const id = +promptSel.value, which = layerSel.value;
  box.textContent = '';
  const shown = [];
  DATA.runs.forEach(r => { const p = r.strips.find(s => s.id === id); if (!p) return;
    const row = which === 'all' ? r.layers.length : r.layers.indexOf(+which);
    shown.push([r, p, row]); });
  let lo = Infinity, hi = -Infinity;
  shown.forEach(([r,p,row]) => { if (row < 0) return; for (let t=0;t<p.length;t++){const q=p.v.q[row*p.length+t];
    if (q>0 && Number.isFinite(q)){const l=Math.log10(q); lo=Math.min(lo,l); hi=Math.max(hi,l);}}});
  if (!(hi >= lo)) { lo = -1; hi = 0; } if (hi === lo) { lo -= 0.5; hi += 0.5; }
  document.getElementById('strip-lo').textContent = 'q ' + fmt(Math.pow(10,lo));
  document.getElementById('strip-hi').textContent = fmt(Math.pow(10,hi));
  shown.forEach(([r,p,row]) => {
    const head = document.createElement('div'); head.className = 'striplabel';
    head.textContent = r.label + (row < 0 ? ' — no layer ' + which : '') + (r.note ? ' — ' + r.note : '');
    head.style.color = r.colour; box.appendChild(head);
    const div = document.createElement('div'); div.className = 'strip'; div.style.borderLeftColor = r.colour;
    for (let t=0;t<p.length;t++){
      const s = document.createElement('span'); s.textContent = p.tokens[t].replace(/\n/g, '\u21b5\n');
      const q = row < 0 ? NaN : p.v.q[row*p.length+t];
      if (q>0 && Number.isFinite(q)) { const c=(Math.log10(q)-lo)/(hi-lo); s.style.background=colour(c);
        s.style.color = c < 0.55 ? '#fff' : '#000'; } else s.style.background = '#eee';
      const get = f => row < 0 ? NaN : p.v[f][row*p.length+t];
      const text = r.label+' · prompt '+p.id+' · position '+t+' · token '+JSON.stringify(p.tokens[t])+
        (p.token_ids[t] >= 0 ? ' (id '+p.token_ids[t]+')' : '')+' · q_t '+fmt(q)+' · loss before '+fmt(get('loss_before'))+
        ' → after '+fmt(get('loss_after'))+' · β '+fmt(get('beta'))+' · ⟨d,k⊙k⟩/‖k‖² '+fmt(get('d_key'));
      s.title = text; s.onmouseenter = () => { info.textContent = text; };
      div.appendChild(s);
    }
    box.appendChild(div);
  });
}
if (promptSel) { promptSel.onchange = draw; layerSel.onchange = draw; draw(); }
document.body.setAttribute('data-ready', '1');
})();
"""


def render(runs: list[RunView], *, title: str = "osdn-diag view") -> str:
    """The page's HTML for ``runs`` (:func:`~osdn_diag.view.data.view_data`)."""
    from .figures import _go

    _go()  # plotly is there, or an ImportError saying how to install it
    from plotly.offline import get_plotlyjs

    figures = {}
    for name, build in FIGURES.items():
        fig = build(runs)
        figures[name] = None if fig is None else _finite(json.loads(fig.to_json()))
    panels = [("contraction", "Contraction curve", "q_geo per relative-position bin, every prompt, layer and head "
               "(summary.json). Hover: bin, q_geo, n."),
              ("layer-head", "Layer × head", "q_geo of every head, one colour scale over the runs. Click a cell: "
               "its curve appears below."),
              ("head-curve", "One head's curve", "The clicked head's q_geo by relative position, every run."),
              ("by-layer", "By layer", "q_geo of each layer, over every prompt and head."),
              ("eps-vs-q", "ε_T^diag vs q_geo by layer", "One point per (prompt, layer, head) stream "
               "(comparator.parquet), coloured by layer."),
              ("d-trajectory", "The preconditioner d", "Runs whose layers have a write-key preconditioner.")]
    blocks = []
    for pid, name, note in panels:
        if figures.get(pid) is None:
            why = {"eps-vs-q": "No run has comparator.parquet (an in-memory replay, or a family the comparator "
                   "does not describe).", "d-trajectory": "No run has a preconditioner d."}.get(pid, "")
            blocks.append(f'<section class="panel" id="panel-{pid}"><h2>{name}</h2><p class="note">{why}</p></section>')
            continue
        blocks.append(f'<section class="panel" id="panel-{pid}"><h2>{name}</h2><p class="note">{note}</p>'
                      f'<div id="{pid}"></div></section>')
    labels = ", ".join(html.escape(r.label) for r in runs)
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}: {labels}</title>",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<style>{_CSS}</style>",
        f"<script>{_ERRORS_JS}</script>",
        f"<script>{get_plotlyjs()}</script>",
        "</head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="note">{labels}. q_t = f_t(S_t)/f_t(S_{{t−1}}), the residual ratio of each write; lower '
        "contracts more. Definitions: docs/metrics.md.</p>",
        '<section id="panel-summary"><h2>Runs: contraction, fidelity and assumption audit</h2>',
        _summary_table(runs), "</section>",
        '<div class="grid">', *blocks, "</div>",
        '<section class="panel" id="panel-strips"><h2>Token strips</h2>',
        f'<p class="note">{html.escape(_strip_note(runs))} Colour: log10 q_t (geometric mean over heads, of the '
        "layer or of every layer), one scale for the runs shown; grey: no finite ratio. Hover a token for its "
        "numbers.</p>",
        '<div class="controls">Prompt<select id="strip-prompt"></select>Layer<select id="strip-layer"></select>'
        '<span id="strip-lo"></span><span id="strip-scale" style="background:linear-gradient(to right,'
        'rgb(68,1,84),rgb(59,82,139),rgb(33,145,140),rgb(94,201,98),rgb(253,231,37))"></span>'
        '<span id="strip-hi"></span></div>',
        '<div id="strip-info">hover a token</div><div id="strips"></div></section>',
        _json_script("osdn-view-data", _data(runs)),
        _json_script("osdn-view-figures", figures),
        f"<script>{_JS}</script>",
        "</body></html>",
    ])


class View:
    """An interactive view of one or more runs: :attr:`html` (the page), :meth:`save`, and in Jupyter
    the page itself, inline (:meth:`_repr_html_`, in an iframe of its own so its script and styles
    stay apart from the notebook's). :attr:`runs`: what it shows (:class:`~osdn_diag.view.data.RunView`)."""

    def __init__(self, runs: list[RunView], *, height: int = 900):
        self.runs = runs
        self.height = height
        self.html = render(runs)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the page to ``path`` (atomically; a symbolic link there is refused, not followed, and so is
        a path that is one of a run's own files or lies among them: ``RUN/summary.json``,
        ``RUN/capture/...``)."""
        return _write(self.html, Path(path))

    def _repr_html_(self) -> str:
        return (f'<iframe srcdoc="{html.escape(self.html, quote=True)}" style="width:100%;height:{self.height}px;'
                'border:1px solid #ddd" sandbox="allow-scripts allow-popups allow-downloads"></iframe>')

    def __repr__(self) -> str:
        return (f"View({', '.join(r.label for r in self.runs)}: {len(self.html) / 1e6:.1f} MB of HTML; "
                ".save(path) writes it, Jupyter shows it)")


def _write(text: str, path: Path) -> Path:
    from ..rundir import check_file_placement
    from ..runtime.atomic import atomic_path, refuse_link

    refuse_link(path)
    check_file_placement(path, "the view's file")  # never one of a run's own files, nor among them
    if path.is_dir():
        raise IsADirectoryError(f"{path}: a directory; give the HTML file's name (e.g. {path / 'view.html'})")
    with atomic_path(path, suffix=".html") as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path


def write_view(runs, out: str | os.PathLike, labels=None, *, strips: int | None = None,
               strip_prompts=None) -> Path:
    """Write the view of ``runs`` (as :func:`~osdn_diag.view.data.view_data` takes them) to ``out``."""
    return View(view_data(runs, labels, strips=strips, strip_prompts=strip_prompts)).save(out)
