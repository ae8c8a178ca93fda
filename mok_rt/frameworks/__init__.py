"""Adapters that run the layer inside frameworks' compiled steps (``torch_ops``: PyTorch custom ops;
``jax_ops``: a ``jax.custom_vjp``, under ``jax.jit`` on the reference backend).  They sit above
the public API and are imported explicitly: importing mok_rt never imports a framework."""
