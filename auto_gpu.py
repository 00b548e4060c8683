# Contract: '"auto" on a GPU picks the Mosaic one where it runs'. Simulate a Hopper CUDA backend.
import jax, paged_jax
from paged_jax import attention as A
class Dev: compute_capability = "9.0"; platform = "gpu"
jax_default_backend = jax.default_backend
A.jax = type("J", (), {"default_backend": staticmethod(lambda: "gpu"), "devices": staticmethod(lambda *a: [Dev()]), "__version__": jax.__version__})
A._default_device = lambda: Dev()
print("resolve_impl('auto') on simulated H100/H200 (cc 9.0):", A.resolve_impl("auto"))
print("contract (design.md, second wave): 'auto' on a GPU picks pallas_mosaic_gpu where it runs")
