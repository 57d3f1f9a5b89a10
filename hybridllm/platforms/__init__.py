"""Per-device platforms: what differs between a CPU worker and a GPU worker, as one object each."""

from hybridllm.platforms.platform import CpuPlatform, CudaPlatform, Platform, platform_for_device

__all__ = ["CpuPlatform", "CudaPlatform", "Platform", "platform_for_device"]
