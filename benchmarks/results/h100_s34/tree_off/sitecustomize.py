# A/B only (session 34): put this folder first on PYTHONPATH and every process runs the GDN recurrence per call
# (fla_gdn_levels.TREE off), what ran before the recurrence over the tree.
import treecompile.ops.fla_gdn_levels as _levels

_levels.TREE = False
