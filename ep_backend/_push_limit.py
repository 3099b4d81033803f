"""The physical limit of the bench: every GPU pushing rows to all its peers at once.

``python -m ep_backend.bench`` reads each high-throughput op's remote GB/s against what the link
moves in the same run, with the ops' SM budget (``Options.num_sms``) and with all SMs. The kernel
is the method of ``benchmarks/probes/nvlink_push_probe.cu`` (one warp per row, 16-byte register
stores, 8 loads in flight per lane, as the HT senders), extended to any number of peers: every
rank's blocks push its rows round-robin over all peers at once, so every link carries traffic in
both directions, as in a dispatch or combine.

The kernel is compiled once per run with ``nvcc`` into a small shared library loaded by ctypes
(no torch headers, no ninja), so the row needs ``nvcc`` on the GPU machine (the CUDA build of
``ep`` needs it too). The receive buffers are ``cudaMalloc`` allocations of their own, mapped into
the peers by CUDA IPC (handles exchanged through the group's store), so the caching allocator's
sub-allocations never reach ``cudaIpcGetMemHandle``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

# The most peers one launch pushes to (ranks of one NVLink domain: 8 GPUs).
MAX_PEERS = 7

_SOURCE = r"""
#include <cuda_runtime.h>
#include <cstdint>
#include <cstring>

constexpr int kMaxPeers = 7;
constexpr int kThreads = 512;  // 16 warps per SM: the probes found >= 8 sending warps needed

struct Peers {
  char* dst[kMaxPeers];  // each peer's receive buffer, at this rank's slot
};

// Row r goes to peer r % num_peers (interleaved: every peer receives from the start), row
// r / num_peers of that peer's slot. One warp copies one row, 8 16-byte loads in flight per lane.
__global__ void __launch_bounds__(kThreads) push_rows(const char* __restrict__ src, Peers peers,
                                                      int num_peers, int rows_per_peer,
                                                      int row_bytes) {
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int warps = gridDim.x * blockDim.x / 32;
  const int n16 = row_bytes / 16;
  const long long rows = static_cast<long long>(rows_per_peer) * num_peers;
  for (long long r = warp; r < rows; r += warps) {
    const int peer = static_cast<int>(r % num_peers);
    const long long slot_row = r / num_peers;
    const int4* s = reinterpret_cast<const int4*>(src + r * row_bytes);
    int4* d = reinterpret_cast<int4*>(peers.dst[peer] + slot_row * row_bytes);
    constexpr int U = 8;
    for (int i = lane; i < n16; i += 32 * U) {
      int4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (i + 32 * u < n16) v[u] = __ldg(s + i + 32 * u);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (i + 32 * u < n16) d[i + 32 * u] = v[u];
    }
  }
}

extern "C" {
// The library links its own (static) CUDA runtime: every entry names the device explicitly.
int ep_probe_set_device(int device) { return cudaSetDevice(device); }
int ep_probe_malloc(void** ptr, size_t bytes) { return cudaMalloc(ptr, bytes); }
int ep_probe_free(void* ptr) { return cudaFree(ptr); }
int ep_probe_ipc_handle(void* ptr, void* handle_out) {
  return cudaIpcGetMemHandle(reinterpret_cast<cudaIpcMemHandle_t*>(handle_out), ptr);
}
int ep_probe_ipc_open(const void* handle, void** ptr) {
  cudaIpcMemHandle_t h;
  memcpy(&h, handle, sizeof(h));
  return cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess);
}
int ep_probe_copy_to_host(void* dst, const void* src, size_t bytes) {
  return cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
}
int ep_probe_ipc_close(void* ptr) { return cudaIpcCloseMemHandle(ptr); }
int ep_probe_handle_bytes() { return static_cast<int>(sizeof(cudaIpcMemHandle_t)); }
const char* ep_probe_error(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }
int ep_probe_push(const void* src, void* const* dst, int num_peers, int rows_per_peer,
                  int row_bytes, int num_sms, void* stream) {
  if (num_peers < 1 || num_peers > kMaxPeers || row_bytes % 16 || num_sms < 1)
    return static_cast<int>(cudaErrorInvalidValue);
  Peers p{};
  for (int i = 0; i < num_peers; ++i) p.dst[i] = static_cast<char*>(dst[i]);
  push_rows<<<num_sms, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const char*>(src), p, num_peers, rows_per_peer, row_bytes);
  return static_cast<int>(cudaGetLastError());
}
}
"""


def compile_probe(cache_dir: Path, arch: str) -> tuple[Path | None, str]:
    """Builds the probe library for ``arch`` (e.g. ``"sm_90a"``): (path, "") or (None, why not).

    The file name holds a hash of the source and the arch, so a run reuses an earlier build.
    """
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        from torch.utils.cpp_extension import CUDA_HOME

        candidate = Path(CUDA_HOME or "/usr/local/cuda") / "bin" / "nvcc"
        nvcc = str(candidate) if candidate.exists() else None
    if nvcc is None:
        return None, "nvcc not found (PATH, CUDA_HOME): the push-limit rows need it"
    digest = hashlib.sha256((_SOURCE + arch).encode()).hexdigest()[:16]
    cache_dir.mkdir(parents=True, exist_ok=True)
    lib = cache_dir / f"ep_push_limit_{digest}.so"
    if lib.exists():
        return lib, ""
    src = cache_dir / f"ep_push_limit_{digest}.cu"
    src.write_text(_SOURCE)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    cmd = [nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", f"-arch={arch}", "-o", str(tmp), str(src)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"nvcc failed: {e}"
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-300:]
        return None, f"nvcc failed ({done.returncode}): {tail}"
    tmp.replace(lib)
    return lib, ""


def device_arch(device: torch.device) -> str:
    """nvcc's ``-arch`` for ``device``: sm_90a on Hopper (as the ep build), else sm_XY."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}" + ("a" if major == 9 else "")


def _address(ptr: ctypes.c_void_p, what: str) -> int:
    """``ptr``'s address; a null pointer (a buffer that was never set up) raises."""
    if ptr.value is None:
        raise RuntimeError(f"push limit probe: {what} is not mapped")
    return ptr.value


class PushLimitProbe:
    """One rank's side of the all-peers push: its source rows, its receive buffer, peer mappings.

    Args:
        library: the library from :func:`compile_probe`.
        store: the group's store (CUDA IPC handles travel through it under ``key``).
        rank, world: this rank and the group size (2..8 ranks, one GPU each).
        device: this rank's GPU.
        row_bytes: bytes of one row (a multiple of 16; the bench uses H x 2, a BF16 row).
        bytes_per_rank: about how many bytes each rank sends per launch, over all its peers.
    """

    def __init__(self, library: Path, store: object, key: str, rank: int, world: int,
                 device: torch.device, row_bytes: int, bytes_per_rank: int) -> None:  # fmt: skip
        if not 2 <= world <= MAX_PEERS + 1:
            raise ValueError(f"push limit: {world} ranks; the probe handles 2..{MAX_PEERS + 1}")
        if row_bytes <= 0 or row_bytes % 16:
            raise ValueError(f"push limit: row_bytes {row_bytes} is not a positive multiple of 16")
        self.lib = ctypes.CDLL(str(library))
        self.lib.ep_probe_error.restype = ctypes.c_char_p
        self.rank, self.world, self.device, self.row_bytes = rank, world, device, row_bytes
        self.num_peers = world - 1
        self.rows_per_peer = max(1, bytes_per_rank // (row_bytes * self.num_peers))
        slot_bytes = self.rows_per_peer * row_bytes
        self.bytes_per_launch = slot_bytes * self.num_peers  # leaves this GPU per launch
        # Seeded by rank: a test can rebuild any rank's rows and check where they landed.
        gen = torch.Generator().manual_seed(rank)
        self.src = torch.randint(0, 256, (self.bytes_per_launch,), dtype=torch.uint8,
                                 generator=gen).to(device)  # fmt: skip
        self.slot_bytes = slot_bytes
        self.recv = ctypes.c_void_p()
        self.opened: list[ctypes.c_void_p] = []
        # Set when mapping the peers' buffers failed: the probe cannot run, the peers' mappings
        # are closed again, and this rank's buffer stays (peers may have mapped it) until the
        # caller frees it after every rank closed (see the bench's _open_push_limit_probe).
        self.setup_error = ""
        dst: list[ctypes.c_void_p] = []
        with torch.cuda.device(device):
            try:
                self._check(self.lib.ep_probe_set_device(device.index))
                self._check(self.lib.ep_probe_malloc(ctypes.byref(self.recv),
                                                     ctypes.c_size_t(slot_bytes * world)))  # fmt: skip
                handle = ctypes.create_string_buffer(self.lib.ep_probe_handle_bytes())
                self._check(self.lib.ep_probe_ipc_handle(self.recv, handle))
            except RuntimeError:
                # An empty handle: the peers fail at once instead of waiting for the store timeout.
                store.set(f"{key}/{rank}", b"")  # type: ignore[attr-defined]
                if self.recv.value:  # never shared: freed now
                    self.lib.ep_probe_free(self.recv)
                    self.recv = ctypes.c_void_p()
                raise
            store.set(f"{key}/{rank}", handle.raw)  # type: ignore[attr-defined]
            try:
                for peer in range(world):
                    if peer == rank:
                        continue
                    raw = store.get(f"{key}/{peer}")  # type: ignore[attr-defined]
                    if not raw:
                        raise RuntimeError(
                            f"push limit probe: rank {peer} has no buffer to push to"
                        )
                    ptr = ctypes.c_void_p()
                    self._check(self.lib.ep_probe_ipc_open(ctypes.c_char_p(bytes(raw)),
                                                           ctypes.byref(ptr)))  # fmt: skip
                    self.opened.append(ptr)
                    # this rank's slot in the peer's buffer
                    dst.append(
                        ctypes.c_void_p(_address(ptr, f"rank {peer}'s buffer") + rank * slot_bytes)
                    )
            except RuntimeError as exc:
                self.setup_error = str(exc)
                for ptr in self.opened:
                    self.lib.ep_probe_ipc_close(ptr)
                self.opened.clear()
                dst = []
        self.dst = (ctypes.c_void_p * self.num_peers)(*dst)

    def _check(self, code: int) -> None:
        if code != 0:
            raise RuntimeError(f"push limit probe: CUDA error {code}: "
                               f"{self.lib.ep_probe_error(code).decode()}")  # fmt: skip

    def launch(self, num_sms: int) -> None:
        """Queues one push of ``bytes_per_launch`` on the current stream with ``num_sms`` blocks."""
        if self.setup_error:
            raise RuntimeError(f"push limit probe: not set up ({self.setup_error})")
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._check(self.lib.ep_probe_set_device(self.device.index))
        self._check(self.lib.ep_probe_push(ctypes.c_void_p(self.src.data_ptr()), self.dst,
                                           self.num_peers, self.rows_per_peer, self.row_bytes,
                                           num_sms, ctypes.c_void_p(stream)))  # fmt: skip

    @staticmethod
    def rows_sent(src_rank: int, dst_rank: int, world: int, rows_per_peer: int,
                  row_bytes: int) -> torch.Tensor:  # fmt: skip
        """What ``src_rank``'s launch writes into ``dst_rank``'s slot: uint8 [rows_per_peer,
        row_bytes] on CPU (rows go round-robin over the sender's peers in rank order)."""
        num_peers = world - 1
        gen = torch.Generator().manual_seed(src_rank)
        src = torch.randint(0, 256, (rows_per_peer * num_peers * row_bytes,), dtype=torch.uint8,
                            generator=gen)  # fmt: skip
        position = dst_rank if dst_rank < src_rank else dst_rank - 1
        return src.view(rows_per_peer, num_peers, row_bytes)[:, position]

    def received(self, src_rank: int) -> torch.Tensor:
        """This rank's slot for ``src_rank``: uint8 [rows_per_peer, row_bytes] on CPU (after the
        sender's launch completed: synchronise and meet at a barrier first)."""
        if src_rank == self.rank or not 0 <= src_rank < self.world:
            raise ValueError(f"received: src_rank {src_rank} is not a peer of rank {self.rank}")
        out = torch.empty(self.rows_per_peer, self.row_bytes, dtype=torch.uint8)
        self._check(self.lib.ep_probe_set_device(self.device.index))
        self._check(self.lib.ep_probe_copy_to_host(
            ctypes.c_void_p(out.data_ptr()),
            ctypes.c_void_p(_address(self.recv, "the receive buffer") + src_rank * self.slot_bytes),
            ctypes.c_size_t(self.slot_bytes)))  # fmt: skip
        return out

    def close(self) -> None:
        """Unmaps the peers' buffers and frees this rank's (after a device synchronise).

        Call it on every rank, then meet at a barrier before the process exits: a peer may still
        write into this rank's buffer until it has synchronised.
        """
        torch.cuda.synchronize(self.device)
        with torch.cuda.device(self.device):
            self._check(self.lib.ep_probe_set_device(self.device.index))
            for ptr in self.opened:
                self._check(self.lib.ep_probe_ipc_close(ptr))
            self.opened.clear()

    def free(self) -> None:
        """Frees this rank's receive buffer (after every peer called :meth:`close`)."""
        if self.recv.value:
            with torch.cuda.device(self.device):
                self._check(self.lib.ep_probe_set_device(self.device.index))
                self._check(self.lib.ep_probe_free(self.recv))
            self.recv = ctypes.c_void_p()


def open_on_every_rank(
    lib: Path,
    store: object,
    key: str,
    rank: int,
    world: int,
    device: torch.device,
    row_bytes: int,
    bytes_per_launch: int,
    agree_on: torch.device,
) -> tuple[PushLimitProbe | None, str]:
    """This rank's probe when every rank of the default group could set one up, else (None, why):
    its timing is collective, so every rank measures the limit or none does.

    ``agree_on``: the device of the tensor the ranks all-reduce the verdict with (the default
    group's backend must serve it). Collective; pair with :func:`close_on_every_rank`.
    """
    import torch.distributed as dist

    probe, why = None, ""
    try:
        probe = PushLimitProbe(lib, store, key, rank, world, device, row_bytes, bytes_per_launch)
        if probe.setup_error:  # its buffer is freed below, once no peer maps it
            why = f"probe failed on rank {rank}: {probe.setup_error}"
    except (OSError, RuntimeError, ValueError) as e:
        why = f"probe failed on rank {rank}: {e}"
    ok = torch.tensor([0 if why else 1], dtype=torch.int64, device=agree_on)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if int(ok.item()) == 1:
        return probe, ""
    close_on_every_rank(probe)
    return None, why or "the probe failed on another rank"


def close_on_every_rank(probe: PushLimitProbe | None) -> None:
    """Unmaps the peers' buffers on every rank, then frees this rank's own once no peer maps it.
    Collective (a barrier of the default group), also for a rank whose probe is None."""
    import torch.distributed as dist

    if probe is not None:
        probe.close()
    dist.barrier()
    if probe is not None:
        probe.free()
