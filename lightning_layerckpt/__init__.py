"""Lightning adapter for layerckpt (targets ``lightning.pytorch``); the callback lands with its own issue."""
