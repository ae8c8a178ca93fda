"""The CUDA runtime layer: checked driver calls, devices and streams, cubins, launches, error words.
Internal."""
