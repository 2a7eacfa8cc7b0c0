"""How near a run came to its network's limit (pure): the figures of a run on shaped links.

Under ``launch.py --hosts N --link-rate R`` every simulated host has one
link, shaped to R each way, and the launcher counts each host's bytes
(``outcome.json``'s ``traffic``; the link it measured is ``link``). From a
run's results and that record:

* **measured bytes per step** on the busiest host and direction: the link
  that bounds the step rate;
* the **traffic model**'s prediction for the same host and direction
  (``launcher/machine/traffic.py``, ``docs/performance.md`` "Bytes per step");
* the **link-bound limit**: the examples/s at which that link would be busy
  all the time, ``rate / bytes per step x global batch``. The rate is the
  one ``tc`` enforces: it meters frames with their headers, as the
  counters count them (the launcher's probe, a payload figure, reads some
  4 % lower);
* the **fraction** of that limit reached.

A synchronous parameter-server update cannot overlap its two transfers:
workers read the new weights only once the ps applied the last update, and
push gradients only once they computed them, so the ps's outgoing and
incoming bytes cross its link one after the other. For it (``serial`` in
the traffic model) the limit is also given as that protocol allows:
``rate / (bytes out + bytes in)`` of the busiest host.
"""

from __future__ import annotations

from tfdist.launcher.machine import traffic as trafficlib

# A host/direction moving less than this share of the busiest one's bytes
# is left out of the model's check: a few kB of control traffic (the
# chief's host, acknowledgements) where the model predicts nothing.
MODEL_CHECK_SHARE = 0.1


def figures(result: dict, outcome: dict | None) -> dict | None:
    """A run's link figures (pure); None when it ran on unshaped links or counted no steps."""
    traffic = (outcome or {}).get("traffic") or {}
    link = (outcome or {}).get("link") or {}
    hosts = traffic.get("hosts") or {}
    rate = link.get("set_bits_per_sec")
    if not traffic.get("steps") or not rate or not hosts:
        return None
    measured = {(name, d): h[f"{d}_bytes_per_step"] for name, h in hosts.items()
                for d in ("tx", "rx")}
    (host, direction), busiest = max(measured.items(), key=lambda kv: kv[1])
    bytes_per_sec = rate / 8
    # Examples per step: a step of gradient accumulation takes N global batches.
    batch = result["global_batch_size"] * (result.get("gradient_accumulation_steps") or 1)
    out = {
        "host": host, "tasks": hosts[host]["tasks"], "direction": direction,
        "bytes_per_step": busiest,
        "hosts": {name: {"tx": h["tx_bytes_per_step"], "rx": h["rx_bytes_per_step"]}
                  for name, h in hosts.items()},
        "link_bits_per_sec": rate, "probe_bits_per_sec": link.get("measured_bits_per_sec"),
        "limit_examples_per_sec": bytes_per_sec / busiest * batch,
    }
    out["fraction"] = result["examples_per_sec"] / out["limit_examples_per_sec"]
    params, trainer = result.get("trainable_params"), traffic.get("trainer")
    if params and trainer:
        model = trafficlib.compare(traffic, params, result.get("gradient_dtype") or "float32")
        out["model_bytes_per_step"] = model[host][f"{direction}_model"]
        checked = {k: (v, model[k[0]][f"{k[1]}_model"]) for k, v in measured.items()
                   if v >= MODEL_CHECK_SHARE * busiest}
        # The worst host/direction: the model's error is that far off somewhere.
        worst = max(checked.items(), key=lambda kv: abs(kv[1][0] / kv[1][1] - 1)
                    if kv[1][1] else float("inf"))
        (w_host, w_dir), (w_meas, w_model) = worst
        out["model_ratio"] = busiest / out["model_bytes_per_step"] if out["model_bytes_per_step"] else None
        out["model_worst"] = {"host": w_host, "direction": w_dir, "measured": w_meas,
                              "model": w_model,
                              "ratio": w_meas / w_model if w_model else None}
    if trafficlib.serial(trainer):
        both = max(h["tx_bytes_per_step"] + h["rx_bytes_per_step"] for h in hosts.values())
        out["serial_limit_examples_per_sec"] = bytes_per_sec / both * batch
        out["serial_fraction"] = result["examples_per_sec"] / out["serial_limit_examples_per_sec"]
    return out
