"""Where a run's GPU memory peaked, from a snapshot that --record-memory-history wrote: the
allocator's events replayed backwards from the blocks alive at the snapshot, the moment the most
bytes were allocated, and what was alive then, summed by the code that allocated it (its
innermost frame in this package, megatron-core or the entry scripts).

  python tools/memory_peak.py snapshot.pickle [--top 20] [--device 0] [--json FILE]

The history holds the newest events only (100,000): the peak is the window's, and a block
allocated before the window is named by the stack its segment recorded, where it has one.
"""

import argparse
import json
import os
import pickle
import sys

OWN_CODE = ("megatron_rl_bi/", "megatron/core/", "megatron/training/", "pretrain_rl.py", "/tools/", "/bench/")
GIB = 2**30


def allocation_site(frames: list[dict]) -> str:
    """The innermost frame in OWN_CODE, else the innermost Python frame, as FILE:LINE:FUNCTION."""
    python = [f for f in frames if f["filename"].endswith(".py")]
    own = [f for f in python if any(part in f["filename"] for part in OWN_CODE)]
    frame = (own or python or [None])[0]
    if frame is None:
        return "(no stack recorded)"
    return f"{frame['filename'].split('site-packages/')[-1]}:{frame['line']}:{frame['name']}"


def live_at_snapshot(snapshot: dict, device: int) -> dict[int, tuple[int, list]]:
    """The blocks allocated when the snapshot was taken: address -> (bytes, frames)."""
    return {block["address"]: (block["size"], block.get("frames", []))
            for segment in snapshot["segments"] if segment["device"] == device
            for block in segment["blocks"] if block["state"] == "active_allocated"}


def _undo(event: dict, live: dict) -> int:
    """Steps `live` back to before `event`; the bytes that changes allocated by. A block counts as
    allocated until its free is requested, as torch.cuda.memory_allocated counts it (a block a
    stream still uses is returned later, at free_completed)."""
    if event["action"] == "alloc":
        live.pop(event["addr"], None)
        return -event["size"]
    if event["action"] == "free_requested":
        live[event["addr"]] = (event["size"], event.get("frames", []))
        return event["size"]
    return 0


def peak(snapshot: dict, device: int) -> tuple[int, int, dict]:
    """(allocated bytes at the peak, how many of the window's events came before it, the blocks
    alive then). Two passes back from the snapshot: one finds the moment, one stops there."""
    events = snapshot["device_traces"][device]
    at_snapshot = live_at_snapshot(snapshot, device)
    live = dict(at_snapshot)
    total = best = sum(size for size, _ in live.values())
    best_at = len(events)
    for i in range(len(events) - 1, -1, -1):
        total += _undo(events[i], live)
        if total > best:
            best, best_at = total, i
    live = at_snapshot
    for i in range(len(events) - 1, best_at - 1, -1):
        _undo(events[i], live)
    return best, best_at, live


def by_site(live: dict) -> list[tuple[str, int, int]]:
    """(allocation site, bytes, blocks), most bytes first."""
    sites: dict[str, list[int]] = {}
    for size, frames in live.values():
        entry = sites.setdefault(allocation_site(frames), [0, 0])
        entry[0] += size
        entry[1] += 1
    return sorted(((site, size, count) for site, (size, count) in sites.items()), key=lambda row: -row[1])


def read_snapshot(path: str, device: int) -> dict:
    if not os.path.isfile(path):
        raise SystemExit(f"memory_peak.py: error: {path}: no such file")
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    traces = snapshot.get("device_traces", [])
    if device >= len(traces) or not traces[device]:
        raise SystemExit(f"memory_peak.py: error: {path}: no allocator events for device {device} (a snapshot "
                         "of --record-memory-history has them)")
    return snapshot


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("snapshot")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--top", type=int, default=20, help="the sites listed, most bytes first")
    parser.add_argument("--json", help="also write the peak and its sites to this file")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    snapshot = read_snapshot(args.snapshot, args.device)
    allocated, before, live = peak(snapshot, args.device)
    sites = by_site(live)
    events = len(snapshot["device_traces"][args.device])
    print(f"peak: {allocated / GIB:.3f} GiB allocated, after {before} of the window's {events} events")
    for site, size, count in sites[:args.top]:
        print(f"{size / GIB:9.3f} GiB  {count:6d} blocks  {site}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peak_gib": allocated / GIB, "events_before": before, "events": events,
                       "sites": [{"site": s, "gib": b / GIB, "blocks": c} for s, b, c in sites]}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
