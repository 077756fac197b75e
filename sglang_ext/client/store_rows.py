"""The store half of a row's try (``extract --store``): take the sample an answer's
manifest names out of the Mooncake Store into ``OUT/hs_<i>`` (``take_from_store``), or on a
rerun the one an earlier run was answered for (``resume_from_store``). Imported by
``runner`` only with ``--store``."""

from __future__ import annotations

import asyncio
import sys
from typing import Any, Dict, Optional, Set

from sglang_ext.client.checks import CheckError
from sglang_ext.client.dataset import Row
from sglang_ext.client.http import Answer, FatalError, RequestError
from sglang_ext.client.manifest import record
from sglang_ext.client.runner import Options, chat_record, expected_ids, put_in_out


async def take_from_store(opts: Options, row: Row, rid: str, answer: Answer,
                          taken: Set[int]) -> Dict[str, Any]:
    """The store half of a try: check the answer's manifest against ``row``, journal it,
    wait for its object (``--store-timeout``) and write it as ``OUT/hs_<i>``; returns the
    manifest record. Raises ``FetchError`` (a ``RequestError``), ``RowError``
    (``expected_ids``), ``CheckError`` or ``OSError``."""
    from sglang_ext.client import fetch

    store = opts.store
    ids = expected_ids(row, answer)
    exp = fetch.expect(answer.manifest, rid, ids, store.shape)  # rid is journaled already
    store.answered(row.index, rid, answer.manifest)
    await store.wait(exp, opts.store_timeout)
    size = await asyncio.to_thread(put_in_out, taken, row.index, store.take, exp, row.index, ids,
                                   opts.validate)
    return chat_record(row, record(row.index, exp.layout.num_tokens, store.source(exp.handle), size))


async def resume_from_store(opts: Options, row: Row, taken: Set[int]) -> Optional[Dict[str, Any]]:
    """A rerun's first try of an unfinished row: take the newest object an earlier run
    was answered for, if it is still in the store (no new request); returns its record, or
    None (nothing journaled, or gone: the row is requested again). Journaled objects that
    cannot be taken stay journaled, removed once the row is done or at the run's end."""
    from sglang_ext.client import fetch

    store = opts.store
    for rid, manifest in reversed(store.resumable(row.index)):
        try:
            if row.chat is not None and row.input_ids is None:
                # the journaled answer's prompt token ids are not kept: a fresh request
                # checks the object against them
                continue
            exp = fetch.expect(manifest, rid, row.input_ids, store.shape)
            if await asyncio.to_thread(store.state, exp.handle) != "ready":
                continue
            size = await asyncio.to_thread(put_in_out, taken, row.index, store.take, exp, row.index,
                                           row.input_ids, opts.validate)
        except FatalError as e:  # the master is gone (StoreFetcher.state): the run stops
            if not isinstance(e, fetch.OtherLayout):  # an earlier server's object: asked again
                raise
            print(f"{row.name}: the sample an earlier run was answered for is not taken "
                  f"({e}); requesting it again", file=sys.stderr)
            continue
        except (RequestError, CheckError, OSError) as e:
            print(f"{row.name}: the sample an earlier run was answered for is not taken "
                  f"({e}); requesting it again", file=sys.stderr)
            continue
        return chat_record(row, record(row.index, exp.layout.num_tokens, store.source(exp.handle),
                                       size))
    return None
