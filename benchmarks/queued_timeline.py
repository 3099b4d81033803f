"""Where does a queued dispatch row's time go? Host and GPU on one time line (2 ranks).

Each sample is queued as in the bench (host barrier, ~1 ms of GPU sleep, L2 flush, one-element
all-reduce, start event, the call, end event). An event recorded on an idle side stream right
after the start event gives the GPU time of one host instant; host CLOCK_MONOTONIC times then map
onto the GPU's. EP_PROFILE_HOST lines (stderr, with start_ns) give the C++ stages' host times.
Printed per op, medians over samples, µs after the start event on the GPU:
  end      the end event (what the bench reports)
  cw_end   the host saw the counts (end of the count wait)
  cxx_ret  the C++ op returned
  py_ret   the Python call returned (the end event is recorded right after)
  map_err  check of the mapping: |side-event span - host span| between two host instants
If end ~ py_ret + a few µs, the host, not the GPU, ends the row.
Usage: python benchmarks/queued_timeline.py [T]   (EP_RECV_SLABS etc. as usual)
"""

import os
import re
import statistics
import sys
import time

import local_ranks
import torch
import torch.distributed as dist


def _parse(line: str) -> tuple[dict[str, float], int]:
    """An EP_PROFILE_HOST line's stages (cumulative µs) and its start (monotonic ns)."""
    cells = dict((k, float(v)) for k, v in re.findall(r"(\S+?)=(\S+)", line))
    start = int(cells.pop("start_ns"))
    cells.pop("pid", None)  # which process wrote the line, not a stage
    cum, acc = {}, 0.0
    for k, v in cells.items():
        if k != "total":
            acc += v
            cum[k] = acc
    return cum, start


def _stage_line(path: str, offset: int) -> tuple[dict[str, float], int, int]:
    """The last dispatch's host stages after ``offset``: cumulative µs from its start, and the
    start (monotonic ns). A deferred count wait (ep.dispatch's eager path) logs a second line,
    "dispatch finish", whose stages are put on the same scale (count_wait, remember)."""
    with open(path, errors="replace") as f:
        f.seek(offset)
        text = f.read()
        end = f.tell()
    found: tuple[dict[str, float], int] | None = None
    for line in text.splitlines():
        m = re.match(r"ep dispatch (finish )?host us:(.*)", line.strip())
        if not m:
            continue
        cum, start = _parse(m.group(2))
        if m.group(1) and found is not None:
            base = found[0]
            shift = (start - found[1]) / 1e3
            merged = dict(base)
            merged.update({k: shift + v for k, v in cum.items()})
            found = (merged, found[1])
        else:
            found = (cum, start)
    assert found is not None, "no EP_PROFILE_HOST dispatch line: is EP_PROFILE_HOST set?"
    return found[0], found[1], end


def worker(rank: int, tokens: int, port: int) -> None:
    err_path = f"/tmp/ep_timeline_rank{rank}.err"
    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    import ep_backend as ep
    from ep_backend import _custom_ops

    local_ranks.join_group(rank, 2, port)
    x, idx, w = local_ranks.standard_inputs(tokens, rank)
    x8, s8 = ep.reference.quantize_fp8_per128(x)
    lead = local_ranks.QueuedLead()
    side = torch.cuda.Stream()
    layout = ep.get_dispatch_layout(idx, 256)
    group = dist.group.WORLD.group_name
    lt = [layout.num_tokens_per_rank, layout.num_tokens_per_expert, layout.is_token_in_rank,
          layout.send_pos]  # fmt: skip
    calls = {
        "FP8, layout given": lambda: ep.dispatch(x8, idx, w, 256, x_scales=s8, layout=layout),
        "FP8, layout, raw op": lambda: _custom_ops._ops.dispatch(
            x8, s8, idx, w, 256, 1, 0, group, lt
        ),
        "BF16, layout given": lambda: ep.dispatch(x, idx, w, 256, layout=layout),
        "FP8": lambda: ep.dispatch(x8, idx, w, 256, x_scales=s8),
        "BF16": lambda: ep.dispatch(x, idx, w, 256),
    }
    keep = os.environ.get("KEEP") == "1"  # hold the outputs until after the end event
    for fn in calls.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    offset = os.path.getsize(err_path)
    for name, fn in calls.items():
        cols: dict[str, list[float]] = {
            k: [] for k in ("end", "cxx_start", "cw_end", "cxx_ret", "py_ret", "map_err")
        }
        for _ in range(int(os.environ.get("SAMPLES", "30"))):
            start = lead.start()
            end = torch.cuda.Event(enable_timing=True)
            mark0 = torch.cuda.Event(enable_timing=True)
            mark1 = torch.cuda.Event(enable_timing=True)
            m0 = time.monotonic_ns()
            mark0.record(side)
            out = fn()
            if not keep:
                del out
            m1 = time.monotonic_ns()
            end.record()
            mark1.record(side)
            end.synchronize()
            mark1.synchronize()
            out = None
            stages, cxx_start, offset = _stage_line(err_path, offset)
            base = start.elapsed_time(mark0) * 1e3  # GPU µs of host instant m0 after start

            def gpu(ns: int) -> float:
                return base + (ns - m0) / 1e3  # noqa: B023 (used right here)

            cols["end"].append(start.elapsed_time(end) * 1e3)
            cols["cxx_start"].append(gpu(cxx_start))
            cols["cw_end"].append(gpu(cxx_start) + stages.get("count_wait", float("nan")))
            cols["cxx_ret"].append(gpu(cxx_start) + max(stages.values()))
            cols["py_ret"].append(gpu(m1))
            cols["map_err"].append(abs(mark0.elapsed_time(mark1) * 1e3 - (m1 - m0) / 1e3))
        med = torch.tensor([statistics.median(v) for v in cols.values()], dtype=torch.float64)
        every = [torch.zeros_like(med) for _ in range(2)]
        dist.all_gather(every, med)
        if rank == 0:
            for r, m in enumerate(every):
                cells = " ".join(f"{k}={v:7.1f}" for k, v in zip(cols, m.tolist(), strict=True))
                print(f"{name:20s} rank {r}: {cells}", flush=True)
            if os.environ.get("RAW"):
                print("  end   ", " ".join(f"{v:.0f}" for v in cols["end"]))
                print("  py_ret", " ".join(f"{v:.0f}" for v in cols["py_ret"]))
                print("  cw_end", " ".join(f"{v:.0f}" for v in cols["cw_end"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("EP_PROFILE_HOST", "1")
    local_ranks.spawn(worker, (int(sys.argv[1]) if len(sys.argv) > 1 else 4096, 29583))
