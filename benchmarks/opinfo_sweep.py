"""OpInfo sweep, ours vs ``torch.distributed.tensor``: which ops give the right values in every layout.

Run ``python benchmarks/opinfo_sweep.py`` for the CI slice (``spmd.testing.op_sweep.SLICE_OPS``),
``--full`` for every OpInfo in PyTorch's ``op_db``, ``--ops add,mm`` for chosen ops, ``--limit N``
for the first N of the chosen ops (sorted by name). The full run takes about 15 minutes on two
CPU cores.

Both libraries run the same harness (``spmd/testing/op_sweep.py``) on the same cases: the samples,
expected values and layouts are prepared once here and handed to torch's processes in a file.
Ours runs on the in-process threaded world of 4 ranks, twice: with the dispatcher's replicate
fallback for ops without a rule (what users get) and without it (the rules alone). torch runs on 4
gloo processes over loopback. An op passes when every case (sample x layout, forward and
backward) matches plain torch; the script prints the counts, the ops only one side passes, and
every FAIL-WRONG (a wrong value: the outcome that must never happen).
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import pickle
import re
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spmd.testing import op_sweep as sweep

WORLD_SIZE = sweep.WORLD_SIZE
GLOO_TIMEOUT_S = 5.0
"""Longest one gloo collective may wait: a case where one rank raised alone (torch's kernels fail
on some ranks' empty shards) costs this much before the ranks move on."""
CASE_TIMEOUT_S = 60.0
"""Longest one case may take in torch's processes before they are replaced."""
RUN_TIMEOUT_S = 1800.0
"""Longest one spawn of torch's processes may take before it is killed."""


# ----- torch's side: gloo processes ------------------------------------------------------------
def torch_library() -> sweep.Library:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    return sweep.Library("torch", init_device_mesh, distribute_tensor, DTensor, Replicate, Shard)


class StoreOutcomeExchange:
    """``OutcomeExchange`` through the rendezvous TCPStore, independent of gloo's collectives.

    It also feeds a watchdog: a process whose case runs past ``CASE_TIMEOUT_S`` exits, and the
    parent starts fresh processes after that case (some of torch's collective waits never time out).
    """

    def __init__(self, store: Any, world_size: int, tag: str) -> None:
        self.store = store
        self.world_size = world_size
        self.tag = tag
        self.last_progress = time.monotonic()
        threading.Thread(target=self._watch, daemon=True).start()

    def exchange(self, rank: int, index: int, outcome: sweep.Outcome) -> list[sweep.Outcome]:
        self.store.set(f"{self.tag}/{index}/{rank}", pickle.dumps(outcome))
        got = [pickle.loads(self.store.get(f"{self.tag}/{index}/{r}")) for r in range(self.world_size)]
        self.last_progress = time.monotonic()
        return got

    def _watch(self) -> None:
        while time.monotonic() - self.last_progress < CASE_TIMEOUT_S:
            time.sleep(1.0)
        os._exit(3)


def _ship(prepared: Sequence[sweep.PreparedOp], max_samples: int) -> bytes:
    """The prepared ops for torch's processes. Callables stay behind (lambdas do not pickle) and an
    op whose samples do not pickle (complex32) goes as its key, to be prepared again over there."""
    entries: list[sweep.PreparedOp | str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in prepared:
            shipped = sweep.PreparedOp(op.key, None, op.samples, op.skip_reason)
            try:
                pickle.loads(pickle.dumps(shipped))
                entries.append(shipped)
            except Exception:
                entries.append(op.key)
        return pickle.dumps((max_samples, entries))


def _unship(data: bytes) -> list[sweep.PreparedOp]:
    max_samples, entries = pickle.loads(data)
    by_key = {sweep.op_key(o): o for o in sweep.load_op_db()}
    prepared: list[sweep.PreparedOp] = []
    for entry in entries:
        if isinstance(entry, str):
            prepared.extend(sweep.prepare_ops([by_key[entry]], max_samples=max_samples))
        else:
            if entry.samples:
                entry.op = by_key[entry.key].op
            prepared.append(entry)
    return prepared


def _gloo_entry(rank: int, port: int, start: int, prepared_path: str, out_path: str, tag: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=RUN_TIMEOUT_S))

    def new_group(generation: int) -> None:
        prefixed = dist.PrefixStore(f"{tag}/group{generation}", store)
        timeout = timedelta(seconds=GLOO_TIMEOUT_S)
        dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=WORLD_SIZE, timeout=timeout)

    new_group(0)
    with open(prepared_path, "rb") as file:
        prepared = _unship(file.read())
    cases = sweep.build_cases(prepared)
    with open(out_path, "ab") as out:

        def record(index: int, outcome: sweep.Outcome) -> None:
            case = cases[index]
            pickle.dump((index, (prepared[case.op_index].key, case.sample_index, case.layout_index), outcome), out)
            out.flush()

        exchange = StoreOutcomeExchange(store, WORLD_SIZE, tag)
        generation = 0
        while start < len(cases):
            start = sweep.sweep_rank(torch_library(), prepared, cases, start, exchange, rank, record)
            if start < len(cases):
                # A case left the ranks out of step (one rank raised while the others waited in a
                # collective): go on with fresh connections rather than fresh processes.
                dist.destroy_process_group()
                generation += 1
                new_group(generation)
    # A case that timed out may leave gloo unable to shut down cleanly; the results are on disk.
    os._exit(0)


CaseId = tuple[str, int, int]
"""(op key, sample index, layout index): names a case the same way in every process."""


def _read_records(path: str) -> dict[int, tuple[CaseId, sweep.Outcome]]:
    """What rank 0 wrote: its case index -> (case id, agreed outcome)."""
    records: dict[int, tuple[CaseId, sweep.Outcome]] = {}
    if not os.path.exists(path):
        return records
    with open(path, "rb") as file:
        while True:
            try:
                index, case_id, outcome = pickle.load(file)
            except (EOFError, pickle.UnpicklingError):
                return records
            records[index] = (case_id, outcome)


def run_torch_sweep(prepared: list[sweep.PreparedOp], max_samples: int) -> list[sweep.Outcome]:
    """Every case on torch's DTensor in 4 gloo processes; a fresh set of processes after a desync."""
    cases = sweep.build_cases(prepared)
    ids = [(prepared[c.op_index].key, c.sample_index, c.layout_index) for c in cases]
    outcomes: dict[CaseId, sweep.Outcome] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prepared_path = os.path.join(tmp, "prepared.pkl")
        with open(prepared_path, "wb") as file:
            file.write(_ship(prepared, max_samples))
        # ``start`` indexes the processes' own case list, which matches ours unless an op had to be
        # prepared again there; outcomes are matched by case id either way.
        start, total, attempt, empty_runs = 0, len(cases), 0, 0
        while start < total:
            attempt += 1
            out_path = os.path.join(tmp, f"outcomes{attempt}.pkl")
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            context = mp.start_processes(
                _gloo_entry,
                args=(store.port, start, prepared_path, out_path, f"run{attempt}"),
                nprocs=WORLD_SIZE,
                join=False,
                start_method="spawn",
            )
            deadline = time.monotonic() + RUN_TIMEOUT_S
            failure = ""
            try:
                while not context.join(timeout=max(1.0, deadline - time.monotonic())):
                    if time.monotonic() >= deadline:
                        failure = f"torch's processes did not finish in {RUN_TIMEOUT_S:g}s"
                        break
            except Exception as error:
                lines = [line for line in str(error).strip().splitlines() if line.strip()]
                failure = f"a torch process died: {lines[-1] if lines else type(error).__name__}"
                if "exit code 3" in failure:
                    failure = f"torch's processes hung on this case for {CASE_TIMEOUT_S:g}s (collective never returned)"
            finally:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                    process.join()
            records = _read_records(out_path)
            outcomes.update(records.values())
            last = max(records, default=start - 1)
            if not records:
                empty_runs += 1
                if empty_runs >= 3:
                    raise RuntimeError(f"torch's processes recorded nothing three times running; last: {failure}")
                failure = failure or "torch's processes exited without recording a case"
            else:
                empty_runs = 0
            if failure:
                # The case after the last one recorded is the one that broke the processes.
                broken = ids[last + 1] if last + 1 < len(ids) else None
                if broken is not None:
                    outcomes.setdefault(broken, sweep.Outcome(sweep.ERROR_OTHER, failure, desync=True))
                last += 1
            start = last + 1
            del store
    return [outcomes.get(i, sweep.Outcome(sweep.ERROR_OTHER, "not run on torch's side")) for i in ids]


# ----- report ----------------------------------------------------------------------------------------
def _passing(reports: Sequence[sweep.OpReport]) -> set[str]:
    return {r.key for r in reports if r.status == sweep.PASS}


def _error_causes(reports: Sequence[sweep.OpReport], top: int = 12) -> list[str]:
    """The most common ERROR-OTHER messages, with numbers and names blurred so alike errors group."""
    counter: collections.Counter[str] = collections.Counter()
    for r in reports:
        if r.status == sweep.ERROR_OTHER:
            detail = r.worst.split(" | ")[-1]
            counter[re.sub(r"\d+", "N", detail)[:160]] += 1
    return [f"{n:4d}  {text}" for text, n in counter.most_common(top)]


def _print_wrong(label: str, reports: Sequence[sweep.OpReport]) -> None:
    wrong = [r for r in reports if r.status == sweep.FAIL_WRONG]
    print(f"\n{label}: FAIL-WRONG in {len(wrong)} ops" + (":" if wrong else ""))
    for r in wrong:
        print(f"  {r.key:<34} {r.worst}")


def _wrapped(keys: Sequence[str]) -> str:
    return "\n".join("    " + ", ".join(keys[i : i + 8]) for i in range(0, len(keys), 8)) or "    (none)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="every OpInfo in op_db (default: the CI slice)")
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names (name or name.variant)")
    parser.add_argument("--limit", type=int, default=0, help="only the first N chosen ops, sorted by name")
    parser.add_argument("--samples", type=int, default=3, help="samples per op (default 3)")
    parser.add_argument("--no-torch", action="store_true", help="skip torch's side")
    parser.add_argument("--verbose", action="store_true", help="print every op that did not pass, per side")
    args = parser.parse_args(argv)

    logging.getLogger("spmd").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    op_db = sorted(sweep.load_op_db(), key=sweep.op_key)
    if args.ops:
        wanted = {name.strip() for name in args.ops.split(",") if name.strip()}
        chosen = [o for o in op_db if sweep.op_key(o) in wanted or o.name in wanted]
        missing = wanted - {sweep.op_key(o) for o in chosen} - {o.name for o in chosen}
        if missing:
            print(f"not in op_db: {', '.join(sorted(missing))}", file=sys.stderr)
    elif args.full:
        chosen = op_db
    else:
        chosen = [o for o in op_db if sweep.op_key(o) in sweep.SLICE_OPS]
    if args.limit:
        chosen = chosen[: args.limit]

    began = time.monotonic()
    prepared = sweep.prepare_ops(chosen, max_samples=args.samples)
    cases = sweep.build_cases(prepared)
    swept = [op for op in prepared if op.samples]
    print(f"{len(chosen)} OpInfos, {len(swept)} swept ({len(chosen) - len(swept)} skipped), "
          f"{len(cases)} cases; prepared in {time.monotonic() - began:.0f}s", flush=True)

    results: dict[str, list[sweep.OpReport]] = {}
    for label, fallback in (("ours", True), ("ours, rules only", False)):
        began = time.monotonic()
        outcomes = sweep.run_threaded_sweep(prepared, fallback=fallback)
        results[label] = sweep.summarize(prepared, outcomes)
        print(f"{label}: {len(_passing(results[label]))} pass ({time.monotonic() - began:.0f}s)", flush=True)
    if not args.no_torch:
        began = time.monotonic()
        results["torch"] = sweep.summarize(prepared, run_torch_sweep(prepared, args.samples))
        print(f"torch: {len(_passing(results['torch']))} pass ({time.monotonic() - began:.0f}s)", flush=True)

    print(f"\nOpInfo ops swept: {len(swept)}")
    for label, reports in results.items():
        counts = collections.Counter(r.status for r in reports if r.status != "SKIP")
        print(f"  {label:<18} " + "  ".join(f"{k} {counts.get(k, 0)}" for k in
                                            (sweep.PASS, sweep.FAIL_WRONG, sweep.ERROR_OTHER, sweep.NOT_IMPLEMENTED)))
    if "torch" in results:
        ours, theirs = _passing(results["ours"]), _passing(results["torch"])
        print(f"\nonly ours passes ({len(ours - theirs)}):\n{_wrapped(sorted(ours - theirs))}")
        print(f"only torch passes ({len(theirs - ours)}):\n{_wrapped(sorted(theirs - ours))}")
        strict = _passing(results["ours, rules only"])
        print(f"only torch passes, against our rules alone ({len(theirs - strict)}):\n{_wrapped(sorted(theirs - strict))}")
    for label, reports in results.items():
        _print_wrong(label, reports)
        causes = _error_causes(reports)
        if causes:
            print(f"{label}: most common ERROR-OTHER causes (ops):")
            print("\n".join(causes))
    if args.verbose:
        for label, reports in results.items():
            print()
            print(sweep.format_report(reports, title=label))
    wrong = sum(1 for r in results["ours"] + results["ours, rules only"] if r.status == sweep.FAIL_WRONG)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
