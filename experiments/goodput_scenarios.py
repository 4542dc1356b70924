"""The at-scale scenario of `goodput_sim.py`: costs of a 405B-parameter run on an H100-class
cluster and the failure rates it meets, from published figures where they exist and stated
assumptions where they do not (`AtScale.sources()` says which is which). Data for the library's
goodput model (`resilient_jax.goodput.model`); the experiment checks its claims on it
(`python experiments/goodput_sim.py --check`)."""

from __future__ import annotations

import dataclasses

from resilient_jax.goodput.model import Cluster, Strategy, Tier

HOUR = 3600.0
DAY = 86400.0

# Llama 3 405B (The Llama 3 Herd of Models, 2024, section 3.3.4): 419 unexpected interruptions in
# a 54-day snapshot on 16,384 H100s, so one per 3.1 h; about 78% attributed to confirmed or
# suspected hardware issues.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_CHIP_MTBF_S = LLAMA3_DAYS * DAY * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS
LLAMA3_HARDWARE_FRACTION = 0.78


@dataclasses.dataclass(frozen=True)
class AtScale:
    """Costs of a 405B-parameter run on an H100-class cluster, from published figures where they
    exist and stated assumptions where they do not (`sources()` says which is which)."""

    chip_mtbf_s: float = LLAMA3_CHIP_MTBF_S
    host_loss_fraction: float = LLAMA3_HARDWARE_FRACTION
    correlated_loss_fraction: float = 0.02
    anomaly_mtbf_s: float = 72 * HOUR  # PaLM 540B: ~20 loss spikes over a run of about 2 months
    params: float = 405e9
    bytes_per_param: float = 14.0  # bf16 weights + fp32 master weights + fp32 Adam m and v
    tokens_per_step: float = 16e6  # Llama 3 405B's final global batch
    peak_flops: float = 989e12  # H100 SXM dense bf16
    mfu: float = 0.40  # Llama 3 405B: 38-43%
    replica_chips: int = 2048  # chips holding one full copy of the state
    chips_per_host: int = 8
    d2h_bytes_per_s: float = 25e9  # per chip; PCIe Gen5 x16 (64 GB/s peak) shared by 8 GPUs
    ram_disk_bytes_per_s: float = 10e9  # per host, host memory into /dev/shm
    storage_write_per_host: float = 1e9
    storage_write_total: float = 2e12  # Llama 3: Tectonic, 2 TB/s sustained
    storage_read_per_host: float = 2e9
    storage_read_total: float = 7e12  # Llama 3: Tectonic, 7 TB/s peak
    persistent_commit_overhead_s: float = 10.0
    persistent_restore_overhead_s: float = 30.0
    local_restore_overhead_s: float = 5.0
    compile_s: float = 180.0  # a cold XLA compile of the step
    framework_compile_s: float = 30.0  # a hit in the persistent compilation cache
    framework_detection_s: float = 10.0
    framework_restart_s: float = 60.0
    baseline_detection_s: float = 100.0  # JAX's default heartbeat timeout
    baseline_restart_s: float = 600.0
    baseline_anomaly_detection_s: float = 600.0

    def state_bytes(self) -> float:
        return self.params * self.bytes_per_param

    def replicas(self, chips: int) -> int:
        return max(1, chips // self.replica_chips)

    def step_s(self, chips: int) -> float:
        flops = 6.0 * self.params * self.tokens_per_step
        return flops / (chips * self.peak_flops * self.mfu)

    def cluster(self, chips: int) -> Cluster:
        return Cluster(
            chips=chips,
            chip_mtbf_s=self.chip_mtbf_s,
            host_loss_fraction=self.host_loss_fraction,
            replicas=self.replicas(chips),
            correlated_loss_fraction=self.correlated_loss_fraction,
            anomaly_mtbf_s=self.anomaly_mtbf_s,
        )

    def _tiers(self, chips: int) -> tuple[Tier, float, float]:
        """(the local tier, persistent write time, persistent restore time)."""
        hosts = max(1, chips // self.chips_per_host)
        per_chip = self.state_bytes() / min(chips, self.replica_chips)
        d2h = per_chip / self.d2h_bytes_per_s
        local = Tier(
            save_s=d2h,
            commit_s=per_chip * self.chips_per_host / self.ram_disk_bytes_per_s,
            restore_s=self.local_restore_overhead_s + d2h,
        )
        write_rate = min(hosts * self.storage_write_per_host, self.storage_write_total)
        write = self.state_bytes() / write_rate + self.persistent_commit_overhead_s
        # Every replica reads a full copy of the state.
        read_rate = min(hosts * self.storage_read_per_host, self.storage_read_total)
        read = self.state_bytes() * self.replicas(chips) / read_rate
        return local, write, read + self.persistent_restore_overhead_s

    def strategies(self, chips: int) -> dict[str, Strategy]:
        """framework: two tiers, async persistent saves, fast detection, in-band anomaly skip.
        baseline: persistent only, synchronous saves, heartbeat-timeout detection, a full job
        restart, rollback on anomalies. baseline_async: the baseline with async saves, to show
        what the rest of the framework adds on top of async checkpointing."""
        local, write, read = self._tiers(chips)
        step = self.step_s(chips)
        framework = Strategy(
            name="framework",
            step_s=step,
            persistent=Tier(local.save_s, write, read),
            local=local,
            detection_s=self.framework_detection_s,
            restart_s=self.framework_restart_s,
            compile_s=self.framework_compile_s,
            anomaly_skip=True,
        )
        baseline = Strategy(
            name="baseline",
            step_s=step,
            persistent=Tier(local.save_s + write, 0.0, read),
            local=None,
            detection_s=self.baseline_detection_s,
            restart_s=self.baseline_restart_s,
            compile_s=self.compile_s,
            anomaly_skip=False,
            anomaly_detection_s=self.baseline_anomaly_detection_s,
        )
        baseline_async = dataclasses.replace(
            baseline, name="baseline_async", persistent=Tier(local.save_s, write, read)
        )
        return {s.name: s for s in (framework, baseline, baseline_async)}

    def sources(self) -> dict[str, str]:
        return {
            "chip_mtbf_s": "Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 "
            "GPUs (job MTBF 3.09 h), scaled per chip",
            "host_loss_fraction": "Llama 3: ~78% of unexpected interruptions attributed to "
            "confirmed or suspected hardware issues; assumed to take the host's RAM disk away",
            "correlated_loss_fraction": "assumption: share of host losses that hit the same "
            "shards in every replica slice (shared power or network domain)",
            "anomaly_mtbf_s": "PaLM 540B: loss spikes roughly 20 times in a run of about two "
            "months; one per 72 h of step time, independent of cluster size",
            "params, bytes_per_param": "405B parameters x 14 B (bf16 weights, fp32 master "
            "weights, fp32 Adam moments): 5.67 TB of checkpoint",
            "tokens_per_step, mfu, peak_flops": "Llama 3 405B: 16M-token batches at 38-43% MFU "
            "on H100 (989 TFLOP/s bf16); step time = 6 N tokens / (chips x peak x MFU); the "
            "global batch is held fixed across cluster sizes",
            "replica_chips": "assumption: one full copy of the state per 2,048 chips (2.8 GB a "
            "chip, within Llama 3's 1 MB-4 GB per GPU checkpoint shards)",
            "d2h_bytes_per_s": "assumption: 25 GB/s device-to-host per chip (PCIe Gen5 x16, "
            "64 GB/s peak, shared by 8 GPUs); the blocking part of every async save",
            "ram_disk_bytes_per_s": "assumption: 10 GB/s per host into /dev/shm (local commit)",
            "storage_write": "Llama 3: Tectonic sustains 2 TB/s; assumption: 1 GB/s per host "
            "writing; +10 s per save for metadata and the commit across thousands of processes",
            "storage_read": "Llama 3: Tectonic peaks at 7 TB/s; assumption: 2 GB/s per host, "
            "every replica reads a full copy, +30 s for listing, opening and verifying",
            "local_restore_overhead_s": "assumption: 5 s to agree on the step, fetch a lost "
            "host's shards from a peer replica and check CRCs",
            "compile_s": "assumption: 180 s to compile a 405B step cold (the baseline: JAX's "
            "compilation cache is off by default)",
            "framework_compile_s": "assumption: 30 s to load the step from the persistent "
            "compilation cache the framework enables (coordinator.compilation_cache_dir)",
            "framework_detection_s": "coordinator heartbeat timeout 5 s (config default) plus "
            "hangs (NCCL watchdog class, 1.7% in Llama 3) caught by the 300 s watchdog",
            "framework_restart_s": "assumption: respawn workers on allocated hosts with a hot "
            "spare for a lost one; MegaScale (NSDI'24) reports job initialisation under 30 s at "
            "more than 10,000 GPUs",
            "baseline_detection_s": "JAX's default heartbeat timeout, 100 s (FIELD_NOTES)",
            "baseline_restart_s": "assumption: job resubmitted through the scheduler, nodes "
            "replaced, containers started, every process re-initialised; MegaScale reports "
            "1,047 s of initialisation at 2,048 GPUs before its optimisations",
            "baseline_anomaly_detection_s": "assumption: an alert on the smoothed loss, then the "
            "job is stopped; PaLM rolled back ~100 steps before each spike",
            "not modelled": "slowdown from background writes; running reshaped while waiting "
            "for a spare; failures needing people",
        }
