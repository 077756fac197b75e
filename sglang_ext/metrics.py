"""Prometheus counters and gauges of the dump writer, on SGLang's ``/metrics``.

SGLang 0.5.17 with ``--enable-metrics`` sets ``PROMETHEUS_MULTIPROC_DIR`` in the main
process before it spawns the schedulers (``engine._set_envs_and_config`` ->
``set_prometheus_multiproc_dir``) and serves ``/metrics`` from a registry with a
``MultiProcessCollector`` over that directory. A metric created in a scheduler process
(which inherits the variable) therefore writes its values to that directory and shows
up on ``/metrics`` without being registered anywhere in the main process. That is
what SGLang's own scheduler metrics do (``observability/metrics_collector.py``); we do
the same from the writer process of each writing rank (``writer_process``, started by
the scheduler, inherits the variable), so no patch hunk is needed.

Names (``kimi_sglang:`` prefix, like SGLang's ``sglang:``), label ``model_name``:

- ``kimi_sglang:dump_files_written_total``, ``kimi_sglang:dump_bytes_written_total``,
  ``kimi_sglang:dump_failures_total`` (counters)
- ``kimi_sglang:dump_queue_depth`` (writes queued or running),
  ``kimi_sglang:dump_host_bytes_in_use`` (bytes of the writer's shared arena in use) (gauges, most recent
  value in multiprocess mode)
- ``kimi_sglang:dump_requests_sampled_total`` (requests admitted for dumping),
  ``kimi_sglang:dump_requests_skipped_total`` (label ``reason``: ``rate``, ``budget``,
  ``disk_floor``) (counters of the scheduler process, ``sampling_counters``)
"""

from __future__ import annotations

import os
from typing import Any, Optional

PREFIX = "kimi_sglang:"


class DumpMetrics:
    """The writer's Prometheus metrics; ``registry`` defaults to prometheus_client's."""

    def __init__(self, model_name: str, registry: Any = None):
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry
        labels = {"model_name": str(model_name)}
        names = list(labels)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, labelnames=names, registry=registry).labels(**labels)

        def gauge(name, doc):
            return Gauge(
                PREFIX + name, doc, labelnames=names, registry=registry,
                # one writer per DP rank, each its own process: the server's level is
                # the sum over the live ones (prometheus_client multiprocess mode)
                multiprocess_mode="livesum",
            ).labels(**labels)

        self.files = counter("dump_files_written", "Hidden-state files written.")
        self.bytes = counter("dump_bytes_written", "Bytes of hidden-state files written.")
        self.failures = counter("dump_failures", "Hidden-state writes that failed.")
        self.queue_depth = gauge("dump_queue_depth", "Hidden-state writes queued or running.")
        self.host_bytes = gauge(
            "dump_host_bytes_in_use", "Bytes of the pinned shared arena held by rows waiting to be written."
        )

    def written(self, nbytes: int) -> None:
        self.files.inc()
        self.bytes.inc(nbytes)

    def failed(self, count: int = 1) -> None:
        self.failures.inc(count)

    def levels(self, *, queue_depth: int, host_bytes_in_use: int) -> None:
        self.queue_depth.set(queue_depth)
        self.host_bytes.set(host_bytes_in_use)


_SAMPLING_FAMILIES: Any = None  # made once per process: each session takes its labels


def sampling_counters(model_name: str, reasons) -> tuple:
    """``(sampled, {reason: skipped})``: the children of
    ``kimi_sglang:dump_requests_sampled_total`` and ``..._skipped_total`` for
    ``model_name`` (and each of ``reasons``, made now so they read 0 before the first
    skip), in prometheus_client's default registry. Created in the scheduler process
    (``sampling.DumpPolicy``): in SGLang's multiprocess mode they reach ``/metrics`` as
    the writer's do. The families are made once per process."""
    global _SAMPLING_FAMILIES
    from prometheus_client import Counter

    if _SAMPLING_FAMILIES is None:
        _SAMPLING_FAMILIES = (
            Counter(PREFIX + "dump_requests_sampled", "Requests admitted for a hidden-state dump.",
                    labelnames=["model_name"]),
            Counter(PREFIX + "dump_requests_skipped",
                    "Requests not dumped by the sampling settings, by reason.",
                    labelnames=["model_name", "reason"]),
        )
    sampled, skipped = _SAMPLING_FAMILIES
    name = str(model_name)
    return sampled.labels(model_name=name), {r: skipped.labels(model_name=name, reason=r) for r in reasons}


def model_name(server_args) -> Optional[str]:
    """The ``model_name`` label when ``--enable-metrics`` is on (as SGLang labels its own
    metrics: ``--served-model-name``, else the model path), else ``None``."""
    if not getattr(server_args, "enable_metrics", False):
        return None
    return getattr(server_args, "served_model_name", None) or server_args.model_path


def mark_dead(pid: int) -> None:
    """Drop writer process ``pid``'s gauges from prometheus_client's multiprocess
    directory (its counters stay), so the server's levels sum over live writers only.
    Called by the writer process at its exit and by the scheduler for one that died;
    nothing without ``PROMETHEUS_MULTIPROC_DIR``. Never raises."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        try:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid)
        except Exception:  # noqa: BLE001 - observability must not fail the dump path
            pass
