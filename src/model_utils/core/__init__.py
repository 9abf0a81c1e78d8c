"""The bottom layer: what every other folder shares and nothing of the project's own is needed for.

Problem and ConfigError (a bad input with its fix), the trainer's exit statuses (read by the launchers too), the names
of every path under --checkpoint_dir, the repository root, and TORCH_CUDA_ARCH_LIST's normalisation (run by the
launchers as a script). Imports only the standard library.
"""
