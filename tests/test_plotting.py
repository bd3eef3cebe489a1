"""course_utils.plotting: image grids, training curves and speed bars (Agg backend, see conftest)."""

import matplotlib.pyplot as plt
import pytest
import torch

from course_utils.plotting import plot_curves, plot_speed, show_images


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def _drawn(fig):
    """Axes that show an image."""
    return [ax for ax in fig.axes if ax.images]


def test_show_images_nhw_with_labels():
    fig = show_images(torch.rand(5, 8, 8), labels=[3, 1, 4, 1, 5], ncols=4)
    assert len(fig.axes) == 8  # 2 rows of 4
    drawn = _drawn(fig)
    assert len(drawn) == 5
    assert [ax.get_title() for ax in drawn] == ["3", "1", "4", "1", "5"]
    assert drawn[0].images[0].get_array().shape == (8, 8)


def test_show_images_nchw_single_channel():
    images = torch.zeros(3, 1, 6, 7)
    images[1, 0, 2, 3] = 1.0
    fig = show_images(images, ncols=3)
    drawn = _drawn(fig)
    assert len(fig.axes) == 3 and len(drawn) == 3
    assert all(ax.get_title() == "" for ax in drawn)
    shown = drawn[1].images[0].get_array()
    assert shown.shape == (6, 7)
    assert shown[2, 3] == 1.0


def test_show_images_rgb_channels_last():
    fig = show_images(torch.rand(2, 3, 4, 5), labels=["a", "b"])
    drawn = _drawn(fig)
    assert len(drawn) == 2
    assert drawn[0].images[0].get_array().shape == (4, 5, 3)
    assert [ax.get_title() for ax in drawn] == ["a", "b"]


def test_show_images_accepts_gradients():
    fig = show_images(torch.rand(2, 4, 4, requires_grad=True))
    assert len(_drawn(fig)) == 2


@pytest.mark.parametrize("shape", [(8, 8), (2, 1, 1, 8, 8), (8,)])
def test_show_images_bad_shape(shape):
    with pytest.raises(ValueError, match=r"\(N, H, W\) or \(N, C, H, W\)"):
        show_images(torch.rand(*shape))


def test_plot_curves_loss_and_accuracy_split():
    fig = plot_curves({"train_loss": [1.0, 0.5, 0.2], "val_loss": [1.1, 0.7, 0.4], "val_acc": [0.5, 0.8, 0.9]}, title="run")
    assert len(fig.axes) == 2
    left, right = fig.axes
    assert sorted(line.get_label() for line in left.get_lines()) == ["train_loss", "val_loss"]
    assert [line.get_label() for line in right.get_lines()] == ["val_acc"]
    assert list(left.get_lines()[0].get_xdata()) == [1, 2, 3]
    assert fig._suptitle.get_text() == "run"


def test_plot_curves_loss_only_single_axes():
    fig = plot_curves({"loss": [3.0, 2.0]})
    assert len(fig.axes) == 1
    assert fig.axes[0].get_xlabel() == "epoch"


def test_plot_speed_bars():
    fig = plot_speed({"loop": 40.0, "vector": 2.5, "gpu": 0.5})
    (ax,) = fig.axes
    widths = [patch.get_width() for patch in ax.patches]
    assert widths == pytest.approx([40.0, 2.5, 0.5])
    labels = [t.get_text() for t in ax.texts]
    assert labels == ["40 ms", "2.5 ms", "0.5 ms"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["loop", "vector", "gpu"]


def test_show_images_warns_nothing():
    """A tensor handed straight to imshow makes numpy 2 warn about __array__(copy=); the grid must not."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        show_images(torch.rand(2, 1, 4, 4), labels=[0, 1])
