"""What a run reports: model-flops utilisation against a chip's peak, by the exact
device kind, and each step's numbers on the terminal, in a JSON-lines file and in
TensorBoard's event files.
"""

import json
import os

import jax

# Peak dense bf16 flop/s per chip, by the device_kind JAX reports, matched exactly (a
# near miss, an H100 NVL or an H200 NVL, has other peaks): NVIDIA's datasheets give
# Tensor Core peaks with sparsity, twice the dense ones; Google's, per TPU chip.
PEAK_FLOPS = {
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    # H100 SXM: 1,979 T with sparsity
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    # H200 SXM
    "NVIDIA H200": 989e12,
    "TPU v4": 275e12,
    # v5e
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    # v5p
    "TPU v5": 459e12,
    "TPU v5p": 459e12,
    # v6e (Trillium)
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    # HGX B200: 4,500 T with sparsity
    "NVIDIA B200": 2250e12,
}


def peak_memory(devices, programs=()) -> str | None:
    """The most memory one of ``devices`` held during the run, and the limit JAX set
    itself; None where the devices keep no count (XLA:CPU's)."""
    # The larger of memory_stats()'s peak_bytes_in_use (PyTorch's max_memory_allocated)
    # and the compiled ``programs``' bytes, both named: a TPU's count has left the
    # programs' temporaries out, and the compiled count is an upper bound.
    stats = [device.memory_stats() for device in devices]
    if not stats or not all(stats):
        return None
    counted = max(s["peak_bytes_in_use"] for s in stats)
    limit = min(s.get("bytes_limit", 0) for s in stats)
    line = (
        f"(of {limit / 1e9:.2f} GB JAX may use; memory_stats() {counted / 1e9:.2f} GB"
    )
    program = max(programs, default=0)
    if program:
        line += f", the compiled step {program / 1e9:.2f} GB"
    return f"peak memory per device {max(counted, program) / 1e9:.2f} GB {line})"


class MetricsLog:
    """Each step's numbers, on process 0: a line on the terminal, and with --log-dir a
    JSON-lines file (metrics.jsonl) and TensorBoard's event files (tensorboardX)."""

    def __init__(self, log_dir: str | None):
        self.on = jax.process_index() == 0
        self.file = self.board = None
        if self.on and log_dir:
            from tensorboardX import SummaryWriter

            os.makedirs(log_dir, exist_ok=True)
            self.file = open(os.path.join(log_dir, "metrics.jsonl"), "a")  # noqa: SIM115
            self.board = SummaryWriter(log_dir)

    def write(self, step: int, line: str, values: dict[str, float]) -> None:
        if not self.on:
            return
        print(line, flush=True)
        if self.file:
            self.file.write(json.dumps({"step": step, **values}) + "\n")
            self.file.flush()
            for name, value in values.items():
                self.board.add_scalar(name, value, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.board.close()
