"""Checkpoints, in one place: how they are written (local.py: atomic files and sharded folders; remote.py: object
stores), found again (the resume point of either), guarded (folder.py: a save_folder another run used; lock.py: one
run a folder), read safely (unpickling.py: nothing in a checkpoint runs code; reading.py: a sharded folder's weights
without the optimizer state) and averaged (ema_weights.py). Imports run one way: folder -> remote -> local."""
