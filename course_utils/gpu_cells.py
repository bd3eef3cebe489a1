"""The %%gpu cell magic: run a cell on a CUDA machine, step aside with a reason elsewhere.

Cells tagged `gpu` start with `%%gpu`. nbval (through course_utils.tooling.pytest_plugin)
reports them as skipped on a CPU; in JupyterLab the magic prints one line instead
of a traceback, so "Run All" carries on past them.
"""

from course_utils.device import cuda_available

SKIP_MESSAGE = "GPU cell skipped: torch.cuda.is_available() is False on this machine, so this cell needs a CUDA GPU to run."


def gpu(line: str, cell: str) -> None:
    """Cell magic body: run `cell` in the user namespace only when CUDA is usable."""
    if not cuda_available():
        print(SKIP_MESSAGE)
        return
    from IPython import get_ipython

    result = get_ipython().run_cell(cell)
    if not result.success:
        # The inner run already showed the traceback; fail the cell without a second one.
        raise GPUCellFailed()


class GPUCellFailed(Exception):
    """Marks a %%gpu cell whose body raised, so nbval and "Run All" stop as for any failing cell."""

    def _render_traceback_(self) -> list[str]:
        return ["GPUCellFailed: the GPU cell raised the error shown above."]
