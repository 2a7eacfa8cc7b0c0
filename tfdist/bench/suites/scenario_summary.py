"""The scenarios suite's figures (pure): each cell's rates and accuracies from its runs' records,
and the targets checked as ratios measured in the same run."""

from __future__ import annotations

from tfdist.bench import link_limit
from tfdist.bench.suites import model_parallel, scaling, sparse
from tfdist.bench.common import BASELINE, group_by_config, time_to_target
from tfdist.bench.suites.scenario_plan import (
    HALF, HALF_ACCURACY_SLACK, HALF_SPEEDUP, LINK_FRACTION, MODEL_TOLERANCE, PEERS,
    PEER_ACCURACY_SLACK, PEER_TARGET, RATIO_TARGETS, SCENARIOS, ScenarioRun, UNIFORM,
    UNIFORM_ACCURACY, ours_config)


# --- summaries (pure) ---------------------------------------------------------------

def rate_from(result: dict, from_step: int) -> tuple[float, int] | None:
    """(examples/s, first step) of a run from its first evaluation at or past
    ``from_step`` to its end, on its eval curve's clock (evaluation left out); pure.

    A tutorial peer's examples/s leaves out its first Keras epoch; this is
    ours over the same part of the run, so neither side's warm-up counts.
    None without an evaluation in the run after ``from_step``.
    """
    curve = result.get("eval_curve") or []
    start = next((p for p in curve if p["step"] >= from_step), None)
    if start is None or start is curve[-1] or curve[-1]["seconds"] <= start["seconds"]:
        return None
    end = curve[-1]
    steps = end["step"] - start["step"]
    return steps * result["global_batch_size"] / (end["seconds"] - start["seconds"]), start["step"]


def summarize(results: dict[str, dict], runs: list[ScenarioRun], targets: dict[str, float],
              outcomes: dict[str, dict] | None = None) -> list[dict]:
    """One row per configuration (scenario and variant, peer, staleness point); pure.

    examples/s is the best of the configuration's runs, every run's figure
    kept; accuracy, time to the scenario's target, staleness and dropped
    gradients come from its accuracy run (the longer, evaluated one); on
    shaped links (``outcomes``: the runs' launch records), the bytes and the
    link's limit from the run whose examples/s the row shows.
    """
    rows = []
    outcomes = outcomes or {}
    for config, group in group_by_config(runs).items():
        first = group[0]
        row = {"config": config, "scenario": first.scenario, "variant": first.variant,
               "kind": first.kind, "workers": first.workers, "peer": first.peer,
               "runs": [{"name": r.name, "phase": r.phase,
                         "examples_per_sec": (results.get(r.name) or {}).get("examples_per_sec")}
                        for r in group],
               "failed": [r.name for r in group if r.name not in results]}
        row["ok"] = not row["failed"]
        done = [(r, results[r.name]) for r in group if r.name in results]
        if done:
            best_run, best = max(done, key=lambda d: d[1]["examples_per_sec"])
            row["examples_per_sec"] = best["examples_per_sec"]
            row["examples_per_sec_each"] = [res["examples_per_sec"] for _, res in done]
            row["link"] = link_limit.figures(best, outcomes.get(best_run.name))
            # The accuracy run, else (throughput only, the staleness study) the last.
            acc = next((res for r, res in done if r.phase != "throughput"), done[-1][1])
            row["test_accuracy"] = acc.get("test_accuracy")
            # The baseline runs beside the uniform scenario, on its work.
            target = targets.get(UNIFORM if config == BASELINE else first.scenario)
            row["target"] = target
            curve = acc.get("eval_curve") or []
            row["time_to_target"] = (time_to_target(curve, target)
                                     if target is not None and curve else None)
            st = acc.get("staleness") or None
            row["staleness"] = ({"mean": st.get("mean"), "p99": st.get("p99"), "max": st.get("max")}
                                if st else None)
            row["dropped"] = acc.get("stale_gradients_dropped")
            row["aggregated"] = acc.get("aggregated_gradients")
            row["steps_per_worker"] = acc.get("steps_per_worker") or {}
            row["global_steps"] = acc.get("global_steps", acc.get("total_steps"))
            row["learning_rate"] = acc.get("learning_rate")
        rows.append(row)
    base = next((r for r in rows if r["config"] == BASELINE and "examples_per_sec" in r), None)
    for row in rows:
        if base is not None and "examples_per_sec" in row and not row["peer"] \
                and row["scenario"] != "staleness":
            row["ratio"] = row["examples_per_sec"] / base["examples_per_sec"]
    peers_by_ours = {p.key: p for p in PEERS}
    by_config = {r["config"]: r for r in rows}
    for row in rows:
        peer = peers_by_ours.get(row["peer"]) if row["peer"] else None
        if peer is None:
            continue
        ours = by_config.get(ours_config(peer))
        row["ours"] = ours["config"] if ours else None
        # Like for like: our runs of the peer's length (each run just before
        # the peer's), the best, over the part of the run the peer's figure
        # covers (after its first Keras epoch); our whole steady figure
        # where a run has no evaluation there.
        same_length = [r["name"] for r in (ours or {}).get("runs", [])
                       if r["phase"] != "throughput" and r["name"] in results]
        peer_runs = [r["name"] for r in row["runs"] if r["name"] in results]
        if same_length and peer_runs:
            skipped = results[peer_runs[0]].get("steps_per_epoch")
            figures = []
            for name in same_length:
                window = rate_from(results[name], skipped) if skipped else None
                figures.append(window or (results[name]["examples_per_sec"], None))
            best = max(figures, key=lambda f: f[0])
            row["ours_steady_examples_per_sec"] = max(results[n]["examples_per_sec"]
                                                      for n in same_length)
            row["ours_examples_per_sec"], row["ours_from_step"] = best
            row["ours_over_peer"] = row["ours_examples_per_sec"] / row["examples_per_sec"]
            row["ours_test_accuracy"] = ours["test_accuracy"]
    return rows


def _short(ratio: float, need: float) -> str:
    return f"{ratio:.2f}× against ≥ {need:g}×: missed by {need - ratio:.2f}× ({(need - ratio) / need:.0%} short)"


def check_targets(rows: list[dict]) -> list[dict]:
    """Each target: what it checks, the measured figure, met or by how much missed; pure."""
    by = {r["config"]: r for r in rows}
    out = []
    for row in rows:
        if not row["peer"]:
            continue
        peer = next(p for p in PEERS if p.key == row["peer"])
        what = f"uniform: ours ({row.get('ours')}) ≥ {PEER_TARGET:g}× {peer.label}, accuracy within {PEER_ACCURACY_SLACK}"
        if "ours_over_peer" not in row:
            out.append({"target": what, "met": None, "text": "not measured (a run failed)"})
            continue
        ratio = row["ours_over_peer"]
        gap = row["ours_test_accuracy"] - row["test_accuracy"]
        acc_ok = gap >= -PEER_ACCURACY_SLACK
        met = ratio >= PEER_TARGET and acc_ok
        parts = [f"{ratio:.2f}×" if ratio >= PEER_TARGET else _short(ratio, PEER_TARGET),
                 f"accuracy {row['ours_test_accuracy']:.4f} vs {row['test_accuracy']:.4f}"
                 + ("" if acc_ok else f" (missed by {-gap - PEER_ACCURACY_SLACK:.4f} beyond the slack)")]
        out.append({"target": what, "met": met, "ratio": ratio, "text": "; ".join(parts)})
    for scenario, variant, against, need, what in RATIO_TARGETS:
        a, b = by.get(f"{scenario}/{variant}"), by.get(f"{scenario}/{against}")
        label = f"{scenario}: {variant} ≥ {need:g}× {against} ({what})"
        if a is None and b is None:
            continue  # scenario not in this run
        if not a or not b or "examples_per_sec" not in a or "examples_per_sec" not in b:
            out.append({"target": label, "met": None, "text": "not measured (a run failed)"})
            continue
        ratio = a["examples_per_sec"] / b["examples_per_sec"]
        out.append({"target": label, "met": ratio >= need, "ratio": ratio,
                    "text": f"{ratio:.2f}×" if ratio >= need else _short(ratio, need)})
    out += sparse.check(rows)
    out += model_parallel.check(rows)
    out += check_links(rows, by)
    uniform = [r for r in rows if r["scenario"] == UNIFORM and not r["peer"]]
    if uniform:
        uniform += [r for r in rows if r["config"] == BASELINE]
        low = [r for r in uniform if (r.get("test_accuracy") or 0) < UNIFORM_ACCURACY]
        worst = min(uniform, key=lambda r: r.get("test_accuracy") or 0)
        text = (f"lowest {worst['config']} {worst.get('test_accuracy') or 0:.4f}" if not low else
                ", ".join(f"{r['config']} {r.get('test_accuracy') or 0:.4f} "
                                       f"(short by {UNIFORM_ACCURACY - (r.get('test_accuracy') or 0):.4f})"
                                       for r in low))
        out.append({"target": f"uniform: every strategy ≥ {UNIFORM_ACCURACY} test accuracy "
                              "in its accuracy run", "met": not low, "text": text})
    return out


def check_links(rows: list[dict], by: dict[str, dict]) -> list[dict]:
    """The network targets (pure): fraction of the link limit, 16-bit speed-up and
    accuracy, the traffic model's error; [] without a shaped-link run."""
    linked = [r for r in rows if r.get("link") and not r["peer"]]
    if not linked:
        return []
    out = []
    shaped = [s.name for s in SCENARIOS.values() if s.link_rate]
    for name in shaped:
        cells = [r for r in linked if r["scenario"] == name and not r["variant"].endswith("-bf16")]
        if not cells:
            continue
        low = [r for r in cells if r["link"]["fraction"] < LINK_FRACTION]
        text = ", ".join(
            f"{r['variant']} {r['link']['fraction']:.0%}"
            + (f" ({(LINK_FRACTION - r['link']['fraction']) * 100:.0f} points short)"
               if r["link"]["fraction"] < LINK_FRACTION else "")
            + (f", {r['link']['serial_fraction']:.0%} of its serial limit"
               if "serial_fraction" in r["link"] else "")
            for r in cells)
        out.append({"target": f"{name}: every multi-process strategy (float32) ≥ "
                              f"{LINK_FRACTION:.0%} of its link-bound limit",
                    "met": not low, "text": text})
        half, full = by.get(f"{name}/multiworker-bf16"), by.get(f"{name}/multiworker")
        label = (f"{name}: multiworker with {HALF} gradients ≥ {HALF_SPEEDUP:g}× float32's "
                 f"examples/s, uniform accuracy within {HALF_ACCURACY_SLACK}")
        if half is None and full is None:
            continue
        u_half, u_full = by.get(f"{UNIFORM}/multiworker-bf16"), by.get(f"{UNIFORM}/multiworker")
        if not (half and full and "examples_per_sec" in half and "examples_per_sec" in full):
            out.append({"target": label, "met": None, "text": "not measured (a run failed)"})
            continue
        ratio = half["examples_per_sec"] / full["examples_per_sec"]
        parts = [f"{ratio:.2f}×" if ratio >= HALF_SPEEDUP else _short(ratio, HALF_SPEEDUP)]
        acc_ok = None
        if u_half and u_full and u_half.get("test_accuracy") is not None \
                and u_full.get("test_accuracy") is not None:
            gap = u_full["test_accuracy"] - u_half["test_accuracy"]
            acc_ok = gap <= HALF_ACCURACY_SLACK
            parts.append(f"uniform accuracy {u_half['test_accuracy']:.4f} vs "
                         f"{u_full['test_accuracy']:.4f}"
                         + ("" if acc_ok else f" (lower by {gap:.4f}, more than "
                                              f"{HALF_ACCURACY_SLACK})"))
        else:
            parts.append("uniform accuracy not measured (run the uniform scenario too)")
        out.append({"target": label, "met": (ratio >= HALF_SPEEDUP and acc_ok)
                    if acc_ok is not None else None, "ratio": ratio, "text": "; ".join(parts)})
    modelled = [r for r in linked + [r for r in rows if r["scenario"] == scaling.SCALING
                                     and r.get("link")]
                if r["link"].get("model_worst")]
    if modelled:
        off = [r for r in modelled
               if abs((r["link"]["model_worst"]["ratio"] or 0) - 1) > MODEL_TOLERANCE]
        worst = max(modelled, key=lambda r: abs((r["link"]["model_worst"]["ratio"] or 0) - 1))
        w = worst["link"]["model_worst"]
        text = (f"worst {worst['config']}: {w['host']} {w['direction']} measured ÷ model "
                f"{w['ratio']:.2f}" + (f"; {len(off)} of {len(modelled)} cells off by more "
                                       f"than {MODEL_TOLERANCE:.0%}: "
                                       + ", ".join(f"{r['config']} {r['link']['model_worst']['ratio']:.2f}"
                                                   for r in off) if off else
                                       f"; all {len(modelled)} cells within {MODEL_TOLERANCE:.0%}"))
        out.append({"target": f"the traffic model predicts every host's bytes per step within "
                              f"{MODEL_TOLERANCE:.0%} (each cell on shaped links)",
                    "met": not off, "text": text})
    return out
