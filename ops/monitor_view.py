"""The monitor's terminal dashboard: a MonitorState snapshot (a dict) drawn with rich.

Pure rendering: `dashboard(snapshot)` returns a rich renderable, `render_text(snapshot,
width)` the same as plain text (`--once` without `--json`, tests, the docs' capture), and
`status_line(snapshot)` one line for a log that is not a terminal.
"""

from __future__ import annotations

import io

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ops.monitor_demand import DEMAND_TARGETS as MEASURED_HERE

BLOCKS = "▁▂▃▄▅▆▇█"
ROLE_STYLE = {"prefill": "orange1", "decode": "dodger_blue1", "colocated": "grey70"}
PHASE_STYLE = {"queued": "yellow", "prefill": "orange1", "decode": "dodger_blue1", "tool": "green"}


def resample(values: list, width: int) -> list:
    """At most `width` values: each the largest of its chunk (a peak stays visible); None where all are None."""
    if width <= 0 or len(values) <= width:
        return list(values)
    out = []
    for i in range(width):
        chunk = [v for v in values[i * len(values) // width : (i + 1) * len(values) // width] if v is not None]
        out.append(max(chunk) if chunk else None)
    return out


def sparkline(values: list, top: float | None = None, width: int = 0) -> str:
    """One character per value (at most `width`), scaled to `top` (default: the largest); None is a blank."""
    values = resample(values, width)
    known = [v for v in values if v is not None]
    top = top if top is not None else max(known, default=0.0)
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        elif top <= 0 or v <= 0:
            out.append(BLOCKS[0] if v is not None and top > 0 else "·")
        else:
            out.append(BLOCKS[min(len(BLOCKS) - 1, int(round(v / top * (len(BLOCKS) - 1))))])
    return "".join(out)


def _num(x, unit: str = "") -> str:
    if x is None:
        return "–"
    x = float(x)
    for cut, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= cut:
            return f"{x / cut:.1f}{suffix}{unit}"
    return f"{x:.0f}{unit}" if abs(x) >= 10 or x == int(x) else f"{x:.1f}{unit}"


def _header(s: dict) -> Text:
    bus = s["bus"]
    t = Text()
    t.append("Prorsa monitor", style="bold")
    t.append(f"  {bus.get('url') or '(no bus)'}")
    if bus.get("source"):
        t.append(f" ({bus['source']})", style="dim")
    if bus.get("run_name"):
        t.append(f"  run {bus['run_name']}")
    t.append(f"  model {s['model_s']:.1f} s" if s.get("model_s") is not None else "")
    if s.get("time_scale"):
        t.append(f" ({s['time_scale']:g}x wall)", style="dim")
    step = s["trajectories"].get("step", -1)
    if step is not None and step >= 0:
        t.append(f"  step {step}")
    t.append("  ● connected" if bus.get("connected") else "  ○ disconnected", style="green" if bus.get("connected") else "red")
    if not s.get("traffic"):
        t.append("\nconnected, but no Prorsa traffic yet: no heartbeat, no lifecycle event (waiting)", style="yellow")
    if bus.get("lifecycle"):
        t.append(f"\nlifecycle: {bus['lifecycle']}", style="dim")
    if bus.get("error"):
        t.append(f"\nlast bus error: {bus['error']}", style="yellow")
    return t


def _engines(s: dict, width: int) -> Panel:
    wide = width >= 110  # narrower: no backend, queued tokens, or prefill/decode split of tokens/s
    table = Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False)
    if wide:
        columns = ["engine", "role", "backend", "epoch", "queue", "running", "KV use", "tok/s", "busy", "heartbeat"]
    else:
        columns = ["engine", "role", "epoch", "queue", "run", "KV", "tok/s", "busy", "age"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("engine", "role", "backend") else "right", no_wrap=True)
    for e in s["engines"]:
        role = Text(e["role"] + (" (switching)" if e["switching"] else ""), style=ROLE_STYLE.get(e["role"], ""))
        kv = f"{e['kv_use']:.0%}" if e["kv_use"] is not None else "–"
        age = Text(f"{e['heartbeat_age_s']:.1f} s", style="bold red" if e["silent"] else "")
        engine = e["engine_id"] + (f" ↻{e['registrations'] - 1}" if e["registrations"] > 1 else "")  # re-registered (restart, lease lapse)
        queue = f"{e['queue_depth']} ({_num(e['queue_tokens'])} tok)" if wide else str(e["queue_depth"])
        tps = f"{_num(e['prefill_tokens_per_s'])} P / {_num(e['decode_tokens_per_s'])} D" if wide else _num(e["tokens_per_s"])
        busy = f"{e['busy']:.0%}" if e["busy"] is not None else "–"
        table.add_row(engine, role, *([e["backend"]] if wide else []), str(e["epoch"]), queue, str(e["running"]), kv, tps, busy, age)
    if not s["engines"]:
        table.add_row("(no engine heartbeat yet)", *[""] * (len(columns) - 1))
    return Panel(table, title="Engines", title_align="left")


def _split(s: dict, width: int) -> Panel:
    sp = s["split"]
    n = (
        max([sp["prefill"] + sp["decode"] + sp["colocated"], *(sum(x) for x in zip(*sp["history"].values()))], default=0)
        if sp["history"]
        else 0
    )
    lines = Text()
    lines.append(f"P:D {sp['ratio']}", style="bold")
    lines.append(f"   {sp['switching']} switching\n")
    for role in ("prefill", "decode", "colocated"):
        lines.append(f"{role:>9} {sp[role]:>3} ", style=ROLE_STYLE[role])
        lines.append(sparkline(sp["history"][role], top=float(n) or None, width=width - 18) + "\n", style=ROLE_STYLE[role])
    lines.append(f"engines per role over the last {sp['window_s']:.0f} model s", style="dim")
    return Panel(lines, title="P:D split", title_align="left")


def _trajectories(s: dict) -> Panel:
    t = s["trajectories"]
    live = t["live"] or 1
    lines = Text()
    lines.append(f"live {t['live']}   started {t['started']}   finished {t['finished']}\n", style="bold")
    for phase in ("queued", "prefill", "decode", "tool"):
        n = t[phase]
        bar = "█" * round(24 * n / live) if t["live"] else ""
        extra = f" (prefill {t['queued_for_prefill']}, decode {t['queued_for_decode']})" if phase == "queued" else ""
        lines.append(f"{phase:>8} {n:>5} ", style=PHASE_STYLE[phase])
        lines.append(bar, style=PHASE_STYLE[phase])
        lines.append(extra + "\n", style="dim")
    lines.append(f"events {t['events_total']}   {t['events_per_s']:.1f}/model s   {t['events_per_wall_s']:.1f}/wall s")
    return Panel(lines, title="Trajectories", title_align="left")


def _demand(s: dict, width: int) -> Panel:
    d = s["demand"]
    table = Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False)
    n_bins = len(next(iter(d["targets"].values()))["measured"]) if d["targets"] else 0
    ahead = f"{d['horizons_s'][0]:g} s ahead" if d["horizons_s"] else "ahead"
    spark_w = max(10, width - 82)
    table.add_column("target", no_wrap=True, min_width=22)
    table.add_column(f"last {n_bins * d['bin_s']:g} model s", no_wrap=True)
    table.add_column("last bin", justify="right", no_wrap=True)
    table.add_column("next bin", justify="right", no_wrap=True)
    table.add_column("horizons " + ",".join(f"{h:g}" for h in d["horizons_s"]) if d["horizons_s"] else "horizons", no_wrap=True)
    for target, v in d["targets"].items():
        if all(x is None for x in v["measured"]) and target not in MEASURED_HERE:  # a target this monitor does not measure: JSON only
            continue
        top = max([x for x in v["measured"] + v["predicted"] if x is not None] or [0.0])
        nxt = v["forecast"][0] if v["forecast"] else None
        table.add_row(target, Text(sparkline(v["measured"], top, spark_w), style="cyan"), _num(v["last_measured"]), "", "")
        table.add_row(
            Text(f"  forecast {ahead}", style="dim"),
            Text(sparkline(v["predicted"], top, spark_w), style="magenta"),
            "",
            _num(nxt),
            Text(sparkline(v["forecast"]), style="magenta"),
        )
    title = "Forecast (magenta) vs measured demand (cyan)"
    if d["tick"] is not None:
        skipped = f", {d['skipped_ticks']} ticks skipped" if d["skipped_ticks"] else ""
        title += f": tick {d['tick']}, {d['model']}, as of {d['as_of_s']:.0f} s ({d['lag_s']:.0f} s behind{skipped}){', FELL BACK to naive' if d['fallback'] else ''}"
    else:
        title += ": no forecast yet"
    return Panel(table, title=title, title_align="left")


def _switches(s: dict) -> Panel:
    sw = s["switches"]
    table = Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False)
    for col in ("model s", "engine", "switch", "epoch", "cost", "why"):
        table.add_column(col, no_wrap=col != "why", justify="right" if col in ("model s", "epoch", "cost") else "left")
    for r in list(reversed(sw["recent"]))[:8]:
        switch = Text()
        switch.append(r["from_role"] or "?", style=ROLE_STYLE.get(r["from_role"], ""))
        switch.append(" → ")
        switch.append(r["role"], style=ROLE_STYLE.get(r["role"], ""))
        table.add_row(
            f"{r['at_s']:.1f}", r["engine_id"], switch, "–" if r["epoch"] is None else str(r["epoch"]), f"{r['cost_s']:.2f}", r["why"]
        )
    for c in sw["commands"]["pending"]:
        table.add_row(
            "pending",
            c["engine_id"],
            f"→ {c['role']}",
            str(c["epoch"]),
            Text(f"{c['age_s']:.1f} s wall", style="red" if c["overdue"] else "yellow"),
            "",
        )
    if not sw["recent"] and not sw["commands"]["pending"]:
        table.add_row("", "(none yet)", "", "", "", "")
    cmd = sw["commands"]
    foot = Text(
        f"{sw['total']} switches, cost {sw['cost_s_total']:.1f} model s (drain + reconfig)\nSetRole: {cmd['sent']} seen, {cmd['acked']} acked, {cmd['refused']} refused",
        style="dim",
    )
    if (d := sw.get("allocator")) is not None:
        foot.append(f"\nallocator @ {d['at_s']:.0f} s ({d['policy']}, {d['split']}): {d['reason']}")
        if (c := d.get("capacity")) is not None:
            foot.append(
                f"\ncapacity, measured over the prior: prefill {c['prefill']}x, decode {c['decode']}x, mixed {c['mixed']}x, KV {c['kv']}x"
            )
    return Panel(Group(table, foot), title="Role switches", title_align="left")


def _health(s: dict) -> Panel:
    lines = Text()
    inv = s["invalid"]
    lines.append(f"malformed messages seen: {inv['total']}", style="red" if inv["total"] else "")
    if inv["by_subject"]:
        lines.append(" (" + ", ".join(f"{k} {v}" for k, v in inv["by_subject"].items()) + ")")
    if inv["reported_by_actors"]:
        lines.append("\nrejected by actors: " + ", ".join(f"{k} {v}" for k, v in inv["reported_by_actors"].items()))
    dl = s["dead_letters"]
    lines.append(f"\ndead letters: {dl['total']}", style="red" if dl["total"] else "")
    if dl["terminated"] or dl["max_deliveries"]:
        lines.append(f" (JetStream gave up on {dl['terminated']} malformed, {dl['max_deliveries']} undeliverable)", style="dim")
    for name, st in s["streams"].items():
        if name == "account" or (not st["messages"] and name not in ("LIFECYCLE", "DEAD")):  # empty queues go without saying
            continue
        full = f", {st['fullness']:.0%} full" if st.get("fullness") is not None else ""
        lines.append(f"\n{name}: {st['messages']} msgs, {_num(st['bytes'], 'B')}{full}", style="dim" if name != "LIFECYCLE" else "")
    alerts = s["alerts"]
    lines.append(f"\n\nalerts: {len(alerts)}", style="bold red" if alerts else "bold green")
    for a in alerts[:10]:
        lines.append(f"\n ! {a['message']}", style="red")
    if len(alerts) > 10:
        lines.append(f"\n … and {len(alerts) - 10} more", style="red")
    return Panel(lines, title="Health and alerts", title_align="left", border_style="red" if alerts else "green")


def _pair(left, right, width: int):
    if width < 100:  # too narrow for two panels side by side
        return Group(left, right)
    grid = Table.grid(expand=True)
    grid.add_column(ratio=1)
    grid.add_column(ratio=1)
    grid.add_row(left, right)
    return grid


def dashboard(s: dict, width: int = 140) -> Group:
    half = width // 2 - 4
    return Group(
        _header(s),
        _engines(s, width),
        _pair(_split(s, half if width >= 100 else width - 4), _trajectories(s), width),
        _pair(_switches(s), _health(s), width),
        _demand(s, width - 4),
    )


def render_text(s: dict, width: int = 140) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False, color_system=None, legacy_windows=False).print(dashboard(s, width))
    return buf.getvalue()


def status_line(s: dict) -> str:
    t, sp = s["trajectories"], s["split"]
    return (
        f"model {s['model_s']:.1f} s | engines {len(s['engines'])} P:D {sp['ratio']} | live {t['live']} "
        f"(queued {t['queued']}, prefill {t['prefill']}, decode {t['decode']}, tool {t['tool']}) finished {t['finished']} | "
        f"{t['events_per_s']:.1f} events/model s | switches {s['switches']['total']} | alerts {len(s['alerts'])}"
        + ("".join(f"; {a['message']}" for a in s["alerts"][:3]))
    )
