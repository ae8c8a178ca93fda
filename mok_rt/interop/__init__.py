"""Tensors in and out: DLPack import/export, element types, the Tensor type mok_rt returns."""
