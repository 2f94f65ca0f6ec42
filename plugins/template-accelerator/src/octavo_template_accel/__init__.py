"""Template accelerator backend for Octavo: the smallest complete backend, to copy and rename."""
