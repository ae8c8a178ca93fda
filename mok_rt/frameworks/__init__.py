"""Adapters that run the layer inside frameworks' compiled steps (PyTorch custom ops).  They sit above
the public API and import their framework lazily: importing mok_rt never imports one."""
