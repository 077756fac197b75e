"""Every benchmark mode in one table: what its cells measure, which server serves them,
how the report reads them and how the plot draws them.

The order of ``MODES`` is the grid's (``plan``: each shape's modes run in it), the
Markdown's within a round and the plot's bars. Adding a mode is one ``Mode`` here, plus the request
it sends (``loadgen``) and, for a new kind of server, its ``servers.KINDS`` entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple


@dataclass(frozen=True)
class Mode:
    name: str
    server: str  # the servers.KINDS key serving it
    label: str = ""  # the plot's legend; "" = not drawn
    color: str = ""
    ratio_label: str = ""  # the plot's ratio panel; "" = no ratio drawn
    dumps: bool = False  # its cells write files: their ratio is a dump's cost
    base: str = "nodump"  # the no-dump mode its ratio divides by (the same engine's)
    peer: bool = False  # served by vLLM (bench.peer)
    grid: bool = True  # run for every shape and round (json: once, at 2k x 8)
    store: bool = False  # its samples go to Mooncake Store (bench/store.py), not files
    control: bool = False  # writes no file; its ratio to its base is reported beside the dumps'
    early: bool = False  # answered before its file (or sample) is complete; a client waits for it later
    fp8: bool = False  # its files hold fp8 rows and scales (server D)
    # a generate cell (bench/gen.py: --gen-tokens per request, output tokens/s): "plain" (no
    # dump), "output" (one pass, the file holds the generated tokens' rows), "two_pass"
    gen: str = ""
    capture: str = ""  # two_pass: the server that captures prompt + generated ids after ``server`` generated


MODES: Tuple[Mode, ...] = (
    Mode("nodump", "A", "(a) no dump", "#4c72b0"),
    # (b): answered after the file
    Mode("dump", "B", "(b) dump", "#dd8452", "(b)/min((a), W/B)", dumps=True),
    # (b'): answered early
    Mode("dump_early", "B", "(b') dump, early answers", "#55a868", "(b')/min((a), W/B)", dumps=True,
         early=True),
    # (b fp8): server D, --dump-hidden-states-dtype fp8
    Mode("dump_fp8", "D", "(b) dump, fp8", "#8172b3", "(b fp8)/min((a), W/B)", dumps=True, fp8=True),
    # (b' fp8): server D, answered early
    Mode("dump_fp8_early", "D", "(b' fp8) dump, fp8, early answers", "#c5b0d5", "(b' fp8)/min((a), W/B)",
         dumps=True, early=True, fp8=True),
    # (s): the store sink (server S, mooncake://), done when the sample is visible in the store
    Mode("dump_store", "S", "(s) store sink", "#937860", "(s)/(a)", dumps=True, store=True),
    # (s'): the store sink, each client waiting for its previous sample, as a trainer would
    Mode("dump_store_early", "S", "(s') store sink, early answers", "#da8bc3", "(s')/(a)", dumps=True,
         store=True, early=True),
    # (a'): server A again, last of the prefill modes in its round (first with --counterbalance's
    # odd rounds): the ratio (a')/(a) is what no change at all measures in that round, the run's
    # noise floor
    Mode("nodump_again", "A", "(a') no dump, again", "#9ecae1", control=True),
    # issue 49, decode (bench/gen.py): (g) generate, no dump; (g out) the same with its output
    # rows in one pass; (g 2p) the field's two passes: generate on A, then capture prompt +
    # generated ids on B
    Mode("gen_nodump", "A", gen="plain"),
    Mode("gen_output", "B", gen="output"),
    Mode("gen_two_pass", "A", gen="two_pass", capture="B"),
    # (c): upstream's JSON return_hidden_states
    Mode("json", "A", "(c) JSON", "#c44e52", grid=False),
    Mode("vllm_nodump", "V", "vLLM (a) no dump", "#4c72b0", peer=True),
    # the peer's (b): vLLM's extract_hidden_states, done when its file is
    Mode("vllm_dump", "W", "vLLM (b) extract_hidden_states", "#dd8452", "vLLM (b)/min(vLLM (a), W/B)",
         dumps=True, base="vllm_nodump", peer=True),
)
BY_NAME: Dict[str, Mode] = {m.name: m for m in MODES}


def names(**flags) -> Tuple[str, ...]:
    """The names of the modes whose fields equal ``flags`` (e.g. ``dumps=True``), in order."""
    return tuple(m.name for m in MODES if all(getattr(m, k) == v for k, v in flags.items()))


def is_gen(mode: str) -> bool:
    """Whether ``mode`` is a generate cell (``Mode.gen``: decode, measured in output tokens/s)."""
    return bool(mode in BY_NAME and BY_NAME[mode].gen)


GEN_MODES = tuple(m.name for m in MODES if m.gen)
