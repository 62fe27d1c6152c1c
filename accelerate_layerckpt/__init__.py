"""HF Accelerate adapter for layerckpt; the plugin lands with its own issue."""
