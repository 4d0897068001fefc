# Put on PYTHONPATH (ahead of the harness' children): the levelled GDN layer as session 21 ran it, for a same-machine
# before/after. The recurrence kernels launched directly but through fla's autotuner stack (kernel[grid]), the
# chunk-local kernels through fla's own functions.
import treecompile.ops.fla_direct as d

d.functions = lambda: {}
_init = d.Launcher.__init__


def _keep(self, kernel):
    _init(self, kernel)
    self.kernel = kernel


d.Launcher.__init__ = _keep
d.Launcher.__call__ = lambda self, grid, **kw: self.kernel[grid](**kw)
