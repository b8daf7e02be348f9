"""The GPUs a train step can be compiled for without one: each target's XLA ``GpuTargetConfig`` and the
compile-only device topology built from it.

JAX's CUDA plugin can compile for devices it does not have: ``jax.experimental.topologies.get_topology_desc(
platform="cuda", topology="1x1xN", target_config=<GpuTargetConfig text proto>)`` gives N devices of
``runtime_type == "compile_only_runtime"``; a ``Mesh`` over them lowers and compiles a jitted function exactly as
a process on those GPUs would, minus GEMM autotuning (no GPU to time tiles on). The figures below are the ones
XLA's own device specs record (``xla/backends/gpu/target_config/specs/{h100_sxm,h100_pcie,h200,a100_sxm_80}.txtpb``
in openxla/xla), written out here as data; the dense bf16 peaks are jaxgpt.devices' (datasheet sparse figures / 2).
The process must run with ``JAX_PLATFORMS=cpu`` (``python -m jaxgpt.compile`` sets it): with no NVIDIA driver the
plugin's start-up check otherwise fails and JAX drops the plugin, topology included.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata

from jaxgpt import devices

PLUGIN = "jax-cuda12-plugin"


class CompileError(RuntimeError):
    """What stops a compile-only GPU build (plugin missing or at another version, unknown target, bad config),
    with the fix in the message."""


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    name: str  # jaxgpt.devices.DEVICES key: its peaks and price
    device_kind: str  # what jax.Device.device_kind reports on the real GPU
    compute_capability: tuple[int, int]
    core_count: int  # SMs
    fpus_per_core: int
    memory_bandwidth: float  # bytes/s (XLA's spec)
    l2_cache_size: int
    clock_rate_ghz: float
    device_memory_size: int  # bytes the driver reports (a little under the marketing 80/141 GB)
    shared_memory_per_core: int
    shared_memory_per_block_optin: int
    source: str

    @property
    def peak_bf16(self) -> float:
        return devices.peak_flops(self.name, "bf16")

    @property
    def peak_fp32(self) -> float:
        """fp32 without tensor cores (the CUDA cores' FMA rate)."""
        return devices.peak_flops(self.name, "fp32")

    def target_config(self) -> str:
        """The ``stream_executor.GpuTargetConfigProto`` text that ``get_topology_desc`` takes."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_core}
  threads_per_core_limit: 2048
  core_count: {self.core_count}
  fpus_per_core: {self.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.memory_bandwidth)}
  l2_cache_size: {self.l2_cache_size}
  clock_rate_ghz: {self.clock_rate_ghz}
  device_memory_size: {self.device_memory_size}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{self.device_kind}"
"""


_HOPPER = dict(compute_capability=(9, 0), core_count=132, fpus_per_core=128, l2_cache_size=50 * 2**20,
               clock_rate_ghz=1.98, shared_memory_per_core=233472, shared_memory_per_block_optin=232448)

TARGETS: dict[str, GpuTarget] = {
    "h100-sxm": GpuTarget("h100-sxm", "NVIDIA H100 80GB HBM3", memory_bandwidth=3.35232e12,
                          device_memory_size=84942979072, source="XLA spec h100_sxm.txtpb", **_HOPPER),
    "h100-pcie": GpuTarget("h100-pcie", "NVIDIA H100 PCIe",
                           **{**_HOPPER, "core_count": 114, "clock_rate_ghz": 1.755},
                           memory_bandwidth=2.03904e12, device_memory_size=84942979072,
                           source="XLA spec h100_pcie.txtpb"),
    "h200": GpuTarget("h200", "NVIDIA H200 141GB HBM3e", memory_bandwidth=4.8e12,
                      device_memory_size=151397597184, source="XLA spec h200.txtpb", **_HOPPER),
    "a100-sxm-80gb": GpuTarget("a100-sxm-80gb", "NVIDIA A100-SXM4-80GB", compute_capability=(8, 0), core_count=108,
                               fpus_per_core=64, memory_bandwidth=2.03904e12, l2_cache_size=40 * 2**20,
                               clock_rate_ghz=1.41, device_memory_size=85100068864, shared_memory_per_core=167936,
                               shared_memory_per_block_optin=166912, source="XLA spec a100_sxm_80.txtpb"),
}


def get_target(name: str) -> GpuTarget:
    key = devices.ALIASES.get(name.lower(), name.lower())
    if key not in TARGETS:
        aliases = ", ".join(a for a, k in devices.ALIASES.items() if k in TARGETS)
        raise CompileError(f"unknown target {name!r}: choose one of {', '.join(TARGETS)} (aliases: {aliases})")
    return TARGETS[key]


def install_command() -> str:
    import jaxlib

    return f'pip install "{PLUGIN}[with-cuda]=={jaxlib.__version__}"'


def plugin_problem() -> str | None:
    """Why a compile-only CUDA topology cannot be built in this process (None when it can)."""
    import jaxlib

    try:
        version = importlib.metadata.version(PLUGIN)
    except importlib.metadata.PackageNotFoundError:
        return (f"JAX's CUDA plugin is not installed (compiling for a GPU without one needs it, ~5 GB of wheels "
                f"with cuDNN and the PTX compiler): {install_command()}")
    if version != jaxlib.__version__:
        return (f"{PLUGIN} {version} does not match jaxlib {jaxlib.__version__} (JAX loads only a plugin of its own "
                f"version): {install_command()}")
    try:
        importlib.metadata.version("nvidia-cudnn-cu12")
    except importlib.metadata.PackageNotFoundError:
        return f"cuDNN is not installed (cuDNN attention cannot lower without it): {install_command()}"
    return None


def topology_devices(target: GpuTarget, n_devices: int) -> list:
    """``n_devices`` compile-only devices of ``target`` (one host): what a Mesh for the compile is built over."""
    import jax
    from jax.experimental import topologies

    problem = plugin_problem()
    if problem:
        raise CompileError(problem)
    if n_devices < 1:
        raise CompileError(f"--devices {n_devices}: need at least 1")
    if "cuda" not in (jax.config.jax_platforms or "cuda") and jax.config.jax_platforms != "cpu":
        raise CompileError(f"JAX_PLATFORMS={jax.config.jax_platforms}: run with JAX_PLATFORMS=cpu")
    try:
        topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{n_devices}",
                                            target_config=target.target_config())
    except Exception as e:  # noqa: BLE001 - the plugin's own errors are RuntimeErrors/XlaRuntimeErrors
        raise CompileError(f"JAX's CUDA plugin could not build a compile-only {target.name} topology ({e}); "
                           f"the process must start with JAX_PLATFORMS=cpu and no other backend initialised "
                           f"(python -m jaxgpt.compile does this), and the plugin must match jaxlib: "
                           f"{install_command()}") from None
    return list(topo.devices)
