"""Adapters that run the layer inside frameworks' compiled steps (``torch_ops``: PyTorch custom ops;
``jax_ops``: a ``jax.custom_vjp`` over XLA FFI custom calls, under ``jax.jit`` on the GPU and the
CPU; ``xla_ffi`` and ``ffi_layer``: its ctypes handlers, without jax).  They sit above
the public API and are imported explicitly: importing mok_rt never imports a framework."""
