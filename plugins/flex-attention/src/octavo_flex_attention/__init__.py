"""Octavo plugin: the cpu backend's attention on torch FlexAttention.

``plugin`` holds the hook (cheap to import), ``envs`` the one switch, ``block_mask`` the block
mask of causal attention after a cached prefix, ``attention`` the ``AttentionImpl``.
"""
