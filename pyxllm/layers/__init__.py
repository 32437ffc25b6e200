"""Model building blocks. Layers call ``pyxllm.kernels.ops``; they hold no device branch."""
