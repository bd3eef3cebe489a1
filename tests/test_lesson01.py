"""Lesson 01's checks against the reference solutions, correct answers written differently, and the wrong answers learners write."""

import copy

import matplotlib
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from course_utils import lesson01 as L
from lesson_contract import assert_names_fault, assert_passes, contract_tests

matplotlib.use("Agg")

PAIRS = [
    (L.check_checkerboard, L.checkerboard),
    (L.check_minmax_scale, L.minmax_scale),
    (L.check_linear, L.linear),
    (L.check_pairwise_sq_distances, L.pairwise_sq_distances),
    (L.check_batch_to, L.batch_to),
    (L.check_target_logits, L.target_logits),
    (L.check_record_frames, L.record_frames),
    (L.check_image_patches, L.image_patches),
]

(test_reference_passes, test_stub_is_not_attempted, test_bad_input_is_one_named_line, test_hostile_answers_are_the_learners_fault,
 test_checks_leave_the_learners_random_state_alone, test_checks_are_quick) = contract_tests(PAIRS)


# checkerboard

def board_floor_divide(h, w, s):
    return ((torch.arange(h)[:, None] // s + torch.arange(w) // s) % 2).float()


def board_kron_then_cut(h, w, s):
    small = L.checkerboard(-(-h // s), -(-w // s), 1)
    return torch.kron(small, torch.ones(s, s))[:h, :w]


def board_repeat_interleave(h, w, s):
    small = L.checkerboard(-(-h // s), -(-w // s), 1)
    return small.repeat_interleave(s, dim=0).repeat_interleave(s, dim=1)[:h, :w]


def board_loop(h, w, s):
    return torch.tensor([[(i // s + j // s) % 2 for j in range(w)] for i in range(h)], dtype=torch.float32)


def board_meshgrid_xor(h, w, s):
    rows, cols = torch.meshgrid(torch.arange(h) // s, torch.arange(w) // s, indexing="ij")
    return ((rows ^ cols) & 1).to(torch.float32)


def board_kron_uncut(h, w, s):
    return torch.kron(L.checkerboard(-(-h // s), -(-w // s), 1), torch.ones(s, s))


def board_remainder_not_division(h, w, s):
    return (((torch.arange(h) % s)[:, None] + torch.arange(w) % s) % 2).float()


# minmax_scale

def scale_min_max_values(x, dim):
    low = x.min(dim, keepdim=True).values
    high = x.max(dim, keepdim=True).values
    return (x - low) / (high - low)


def scale_aminmax(x, dim):
    low, high = torch.aminmax(x, dim=dim, keepdim=True)
    return torch.sub(x, low).div(high - low)


def scale_unsqueeze(x, dim):
    low, high = x.amin(dim).unsqueeze(dim), x.amax(dim).unsqueeze(dim)
    return (x - low) / (high - low)


def scale_movedim(x, dim):
    y = x.movedim(dim, -1)
    y = (y - y.amin(-1, keepdim=True)) / (y.amax(-1, keepdim=True) - y.amin(-1, keepdim=True))
    return y.movedim(-1, dim)


def scale_without_keepdim(x, dim):
    return (x - x.amin(dim)) / (x.amax(dim) - x.amin(dim))


def scale_min_pairs(x, dim):
    return (x - x.min(dim)) / (x.max(dim) - x.min(dim))


def scale_in_place(x, dim):
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    return x.sub_(low).div_(high - low)


def scale_half_keepdim(x, dim):
    return (x - x.amin(dim, keepdim=True)) / (x.amax(dim) - x.amin(dim))


# target_logits

def logits_take_along_dim(logits, targets):
    return torch.take_along_dim(logits, targets.unsqueeze(-1), dim=-1).squeeze(-1)


def logits_one_hot(logits, targets):
    return (logits * F.one_hot(targets, logits.shape[-1]).to(logits.dtype)).sum(-1)


def logits_flat_rows(logits, targets):
    rows = logits.reshape(-1, logits.shape[-1])
    return rows[torch.arange(rows.shape[0]), targets.reshape(-1)].reshape(targets.shape)


def logits_where(logits, targets):
    return torch.where(torch.arange(logits.shape[-1]) == targets[..., None], logits, 0).sum(-1)


def logits_gather_last_by_number(logits, targets):
    return logits.gather(logits.ndim - 1, targets[..., None])[..., 0]


def logits_bare_squeeze(logits, targets):
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze()


def logits_dim_one(logits, targets):
    return logits.gather(1, targets.unsqueeze(1)).squeeze(1)


def logits_arange_rows(logits, targets):
    return logits[torch.arange(len(targets)), targets]


def logits_unsqueezed_in_place(logits, targets):
    return logits.gather(-1, targets.unsqueeze_(-1)).squeeze(-1)


# image_patches

def patches_unfold(image, p):
    return image.unfold(0, p, p).unfold(1, p, p).reshape(-1, p * p)


def patches_contiguous_view(image, p):
    h, w = image.shape
    return image.reshape(h // p, p, w // p, p).transpose(1, 2).contiguous().view(-1, p * p)


def patches_loop(image, p):
    h, w = image.shape
    return torch.stack([image[i:i + p, j:j + p].flatten() for i in range(0, h, p) for j in range(0, w, p)])


def patches_flatten(image, p):
    h, w = image.shape
    return image.view(h // p, p, w // p, p).permute(0, 2, 1, 3).flatten(0, 1).flatten(1)


def patches_im2col(image, p):
    return F.unfold(image[None, None].double(), p, stride=p)[0].T.to(image.dtype)


def patches_split(image, p, order=(0, 2, 1, 3)):
    h, w = image.shape
    return image.reshape(h // p, p, w // p, p).permute(*order)


def patches_square_only(image, p):
    n = image.shape[0] // p
    return image.reshape(n, p, n, p).permute(0, 2, 1, 3).reshape(-1, p * p)


def patches_in_place(image, p):
    image[0, 0] = image[0, 1]  # "cleans" a pixel of the caller's image
    return L.image_patches(image, p)


def patches_fixed_example_size(image, p):
    return image.view(2, 2, 3, 2).permute(0, 2, 1, 3).reshape(-1, 4)  # the 4 x 6 example's sizes, typed in


def patches_view_at_the_end(image, p):
    h, w = image.shape
    return image.view(h // p, p, w // p, p).permute(0, 2, 1, 3).view(-1, p * p)


# record_frames

def frames_copy_then_wrap(camera, n):
    return torch.stack([torch.from_numpy(camera.read().copy()) for _ in range(n)]).float()


def frames_preallocated(camera, n):
    out = None
    for i in range(n):
        frame = torch.from_numpy(camera.read())
        if out is None:
            out = torch.empty(n, *frame.shape)
        out[i] = frame  # indexed assignment copies into out
    return out


def frames_clone(camera, n):
    return torch.stack([torch.from_numpy(camera.read()).clone() for _ in range(n)]).to(torch.float32)


def frames_numpy_astype(camera, n):
    return torch.from_numpy(np.stack([camera.read().astype(np.float32) for _ in range(n)]))


def frames_shared(camera, n):
    return torch.stack([torch.from_numpy(camera.read()) for _ in range(n)]).float()


def frames_float_per_frame(camera, n):
    return torch.stack([torch.from_numpy(camera.read()).float() for _ in range(n)])


def frames_as_tensor(camera, n):
    return torch.stack([torch.as_tensor(camera.read(), dtype=torch.float32) for _ in range(n)])


def frames_numpy_stack_of_one_buffer(camera, n):
    return torch.from_numpy(np.stack([camera.read() for _ in range(n)])).float()


def frames_cat(camera, n):
    return torch.cat([torch.tensor(camera.read(), dtype=torch.float32) for _ in range(n)])


def frames_list(camera, n):
    return [torch.tensor(camera.read(), dtype=torch.float32) for _ in range(n)]


def frames_no_cast(camera, n):
    return torch.stack([torch.tensor(camera.read()) for _ in range(n)])


def frames_reversed(camera, n):
    return L.record_frames(camera, n).flip(0)


def frames_scaled(camera, n):
    return L.record_frames(camera, n) / 255


def frames_read_one_too_many(camera, n):
    camera.read()  # "warm up" the camera
    return L.record_frames(camera, n)


def frames_shared_when_one(camera, n):
    if n == 1:
        return torch.from_numpy(camera.read()).float()[None]
    return L.record_frames(camera, n)


def frames_float_on_numpy(camera, n):
    return torch.stack([camera.read().float() for _ in range(n)])


# batch_to

def to_comprehension(batch, device):
    return {k: (v.to(device=device, dtype=torch.float32) if torch.is_floating_point(v) else v.to(device))
            if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def to_copied_dict(batch, device):
    out = dict(batch)
    for k, v in out.items():
        if torch.is_tensor(v):
            out[k] = v.float().to(device) if v.dtype.is_floating_point else v.to(device)
    return out


def to_deepcopy(batch, device):
    out = copy.deepcopy(batch)
    for k, v in out.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.to(device, torch.float32 if v.is_floating_point() else None)
    return out


def to_in_place(batch, device):
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            batch[k] = v.to(device, torch.float32 if v.is_floating_point() else v.dtype)
    return batch


def to_all_float(batch, device):
    return {k: v.to(device, torch.float32) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def to_no_cast(batch, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def to_only_float64(batch, device):
    return {k: (v.to(device, torch.float32) if v.dtype == torch.float64 else v.to(device)) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


def to_ignoring_device(batch, device):
    return {k: (v.float() if v.is_floating_point() else v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def to_tensors_only(batch, device):
    return {k: v.to(device, torch.float32 if v.is_floating_point() else v.dtype) for k, v in batch.items() if isinstance(v, torch.Tensor)}


def to_everything(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


def to_cuda(batch, device):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def to_nothing(batch, device):
    return batch


def to_through_data(batch, device):
    for v in batch.values():
        if isinstance(v, torch.Tensor):
            v.data = v.data.to(device, torch.float32 if v.is_floating_point() else v.dtype)
    return dict(batch)


def to_numbers_as_tensors(batch, device):
    out = L.batch_to(batch, device)
    out["step"] = torch.tensor(batch["step"], device=device)
    return out


ALTERNATIVES = [
    (L.check_image_patches, patches_unfold),
    (L.check_image_patches, patches_contiguous_view),
    (L.check_image_patches, patches_loop),
    (L.check_image_patches, patches_flatten),
    (L.check_image_patches, patches_im2col),
    (L.check_checkerboard, board_floor_divide),
    (L.check_checkerboard, board_kron_then_cut),
    (L.check_checkerboard, board_repeat_interleave),
    (L.check_checkerboard, board_loop),
    (L.check_checkerboard, board_meshgrid_xor),
    (L.check_minmax_scale, scale_min_max_values),
    (L.check_minmax_scale, scale_aminmax),
    (L.check_minmax_scale, scale_unsqueeze),
    (L.check_minmax_scale, scale_movedim),
    (L.check_pairwise_sq_distances, lambda a, b: torch.cdist(a, b) ** 2),
    (L.check_pairwise_sq_distances, lambda a, b: (a ** 2).sum(1, keepdim=True) + (b ** 2).sum(1) - 2 * a @ b.T),
    (L.check_pairwise_sq_distances, lambda a, b: ((a.unsqueeze(1) - b.unsqueeze(0)) ** 2).sum(2)),
    (L.check_pairwise_sq_distances, lambda a, b: torch.einsum("nmd,nmd->nm", a[:, None] - b, a[:, None] - b)),
    (L.check_linear, F.linear),
    (L.check_linear, lambda x, w, b: x.matmul(w.t()) + b),
    (L.check_linear, lambda x, w, b: torch.einsum("...i,oi->...o", x, w) + b),
    (L.check_linear, lambda x, w, b: (x.unsqueeze(-2) * w).sum(-1) + b),
    (L.check_linear, lambda x, w, b: (x @ w.mT).add_(b)),
    (L.check_record_frames, frames_copy_then_wrap),
    (L.check_record_frames, frames_preallocated),
    (L.check_record_frames, frames_clone),
    (L.check_record_frames, frames_numpy_astype),
    (L.check_batch_to, to_comprehension),
    (L.check_batch_to, to_copied_dict),
    (L.check_batch_to, to_deepcopy),
    (L.check_target_logits, logits_take_along_dim),
    (L.check_target_logits, logits_one_hot),
    (L.check_target_logits, logits_flat_rows),
    (L.check_target_logits, logits_where),
    (L.check_target_logits, logits_gather_last_by_number),
]


@pytest.mark.parametrize("check, answer", ALTERNATIVES, ids=lambda v: getattr(v, "exercise_name", None) or getattr(v, "__name__", ""))
def test_correct_alternatives_pass(check, answer):
    assert_passes(check, answer)


WRONG = [
    # image_patches
    (L.check_image_patches, lambda im, p: im.reshape(-1, p * p), "pixels in reading order"),
    (L.check_image_patches, patches_view_at_the_end, r"image of shape \(6, 8\), p=2\) raised RuntimeError: view size .*\(view\(\) of a non-contiguous tensor; reshape\(\) copies"),
    (L.check_image_patches, lambda im, p: patches_split(im, p, (2, 0, 1, 3)).reshape(-1, p * p), "patches come in another order"),
    (L.check_image_patches, lambda im, p: patches_split(im, p, (0, 2, 3, 1)).reshape(-1, p * p), "flattened column by column"),
    (L.check_image_patches, lambda im, p: patches_split(im, p), r"expected shape \(12, 4\), got \(3, 4, 2, 2\)"),
    (L.check_image_patches, lambda im, p: L.image_patches(im, p).float(), r"\(6, 12\), p=3\): expected dtype torch.int64, got torch.float32"),
    (L.check_image_patches, patches_square_only, "raised RuntimeError.*a shape that does not fit this image"),
    (L.check_image_patches, lambda im, p: L.image_patches(im, 2), r"\(6, 12\), p=3\): your patches are 2x2, whatever p is"),
    (L.check_image_patches, patches_fixed_example_size, r"shape '\[2, 2, 3, 2\]' is invalid.*work the sizes out from image.shape and p"),
    (L.check_image_patches, lambda im, p: patches_split(im, p, (1, 3, 0, 2)).reshape(-1, p * p), "wrong values.*right values in the wrong places"),
    (L.check_image_patches, patches_in_place, "modified its input in place"),
    # checkerboard
    (L.check_checkerboard, lambda h, w, s: L.checkerboard(h, w, 1), r"checkerboard\(height=6, width=8, square=2\): your squares are 1 pixel wide"),
    (L.check_checkerboard, board_remainder_not_division, "your squares are 1 pixel wide"),
    (L.check_checkerboard, lambda h, w, s: 1 - L.checkerboard(h, w, s), "is inverted: the top-left square should be 0"),
    (L.check_checkerboard, lambda h, w, s: L.checkerboard(w, h, s), r"expected shape \(6, 8\), got \(8, 6\): height is the number of rows"),
    (L.check_checkerboard, board_kron_uncut, r"square=2\): expected shape \(5, 7\), got \(6, 8\): whole squares that run past the edge"),
    (L.check_checkerboard, lambda h, w, s: (torch.arange(h)[:, None] // s + torch.arange(w) // s) % 2,
     "expected dtype torch.float32, got torch.int64: an integer tensor"),
    (L.check_checkerboard, lambda h, w, s: (torch.arange(h)[:, None] // s + torch.arange(w) // s) % 2 == 1, "got torch.bool: a comparison gives a bool tensor"),
    (L.check_checkerboard, lambda h, w, s: L.checkerboard(h, w, s).double(), "expected dtype torch.float32, got torch.float64"),
    (L.check_checkerboard, lambda h, w, s: ((torch.arange(h)[:, None] + torch.arange(w)) // s % 2).float(), r"square=2\): wrong values"),
    (L.check_checkerboard, lambda h, w, s: L.checkerboard(h, h, s), r"expected shape \(6, 8\), got \(6, 6\)"),
    (L.check_checkerboard, lambda h, w, s: L.checkerboard(h, w, s).flatten(), r"expected shape \(6, 8\), got \(48,\)"),
    # minmax_scale
    (L.check_minmax_scale, scale_without_keepdim, r"x of shape \(4, 4\), dim=1\): the min and max of each slice are lined up with the wrong dimension.*keepdim=True"),
    (L.check_minmax_scale, scale_min_pairs, r"raised TypeError.*return a pair \(values, indices\): take .values"),
    (L.check_minmax_scale, lambda x, dim: (x - x.min()) / (x.max() - x.min()), "the whole tensor: scale each slice along dim by its own"),
    (L.check_minmax_scale, lambda x, dim: L.minmax_scale(x, 1), r"dim=-1\): you scaled the slices along dim 1, not along the dim=-1 you were given"),
    (L.check_minmax_scale, lambda x, dim: L.minmax_scale(x, -1), r"\(5, 3\), dim=0\): you scaled the slices along dim 1, not along the dim=0"),
    (L.check_minmax_scale, scale_in_place, "modified its input in place"),
    (L.check_minmax_scale, lambda x, dim: L.minmax_scale(x, dim).float(), r"float64, dim=1\): expected dtype torch.float64, got torch.float32"),
    (L.check_minmax_scale, lambda x, dim: (x - x.amin(dim, keepdim=True)) / x.amax(dim, keepdim=True), "wrong values"),
    (L.check_minmax_scale, lambda x, dim: x - x.amin(dim, keepdim=True) / (x.amax(dim, keepdim=True) - x.amin(dim, keepdim=True)), "wrong values"),
    (L.check_minmax_scale, lambda x, dim: (x - x.mean(dim, keepdim=True)) / x.std(dim, keepdim=True), "wrong values"),
    (L.check_minmax_scale, scale_half_keepdim, r"\(4, 4\), dim=1\): wrong values"),
    # pairwise_sq_distances
    (L.check_pairwise_sq_distances, lambda a, b: ((a[None] - b[:, None]) ** 2).sum(-1), r"expected shape \(5, 4\), got \(4, 5\): is it transposed"),
    (L.check_pairwise_sq_distances, lambda a, b: L.pairwise_sq_distances(a, b).T if len(a) == len(b) else L.pairwise_sq_distances(a, b),
     "holds the distance from b.i. to a.j.: is it transposed"),
    (L.check_pairwise_sq_distances, lambda a, b: (a[:, None] - b[None]).norm(dim=-1), "the distances, not their squares"),
    (L.check_pairwise_sq_distances, lambda a, b: ((a[:, None] - b[None]) ** 2).mean(-1), "divided by d = 3: sum over the coordinates"),
    (L.check_pairwise_sq_distances, lambda a, b: ((a[:, None] - b[None]) ** 2).sum(0), "expected shape"),
    (L.check_pairwise_sq_distances, lambda a, b: (a[:, None] - b[None]) ** 2, r"expected shape \(5, 4\), got \(5, 4, 3\)"),
    (L.check_pairwise_sq_distances, lambda a, b: ((a - b) ** 2).sum(1), "raised RuntimeError.*shapes that do not broadcast"),
    (L.check_pairwise_sq_distances, lambda a, b: a @ b.T, "wrong values"),
    (L.check_pairwise_sq_distances, lambda a, b: L.pairwise_sq_distances(a, b).float(), "float64.*expected dtype torch.float64, got torch.float32"),
    (L.check_pairwise_sq_distances, lambda a, b: ((a.unsqueeze_(1) - b) ** 2).sum(-1), "modified its input in place"),
    # linear
    (L.check_linear, lambda x, w, b: x @ w + b, r"you computed x @ weight \+ bias.*weight\.T"),
    (L.check_linear, lambda x, w, b: x @ w.T, "the bias is missing"),
    (L.check_linear, lambda x, w, b: x * w + b, "raised RuntimeError.*broadcast"),
    (L.check_linear, lambda x, w, b: torch.mm(x, w.T) + b, r"linear\(x of shape \(4,\).*raised RuntimeError"),
    (L.check_linear, lambda x, w, b: w @ x + b, "raised RuntimeError.*shapes cannot be multiplied"),
    (L.check_linear, lambda x, w, b: torch.einsum("bi,oi->bo", x, w) + b, r"linear\(x of shape \(4,\).*raised RuntimeError"),
    (L.check_linear, lambda x, w, b: (x @ w.T + b).float(), "float64.*expected dtype torch.float64, got torch.float32"),
    (L.check_linear, lambda x, w, b: x @ w.t_() + b, "modified its input in place"),
    (L.check_linear, lambda x, w, b: (x + b) @ w.T, r"linear\(x of shape \(2, 3\).*wrong values"),
    (L.check_linear, lambda x, w, b: x @ w.T - b, "wrong values"),
    # record_frames
    (L.check_record_frames, frames_shared, "every frame of your result is the last one read: camera.read.. returns the same array every time"),
    (L.check_record_frames, frames_float_per_frame, "float32 frames.*though uint8 frames worked"),
    (L.check_record_frames, frames_as_tensor, "float32 frames.*returns the same memory"),
    (L.check_record_frames, frames_numpy_stack_of_one_buffer, "the last one read"),
    (L.check_record_frames, frames_cat, r"expected shape \(4, 3, 5\), got \(12, 5\): the frames are joined along their rows"),
    (L.check_record_frames, frames_list, "is a list, expected a torch.Tensor"),
    (L.check_record_frames, frames_no_cast, "expected dtype torch.float32, got torch.uint8"),
    (L.check_record_frames, frames_reversed, "reverse order"),
    (L.check_record_frames, frames_scaled, "divided by 255"),
    (L.check_record_frames, frames_read_one_too_many, r"read 5 frame\(s\) from the camera, expected 4"),
    (L.check_record_frames, frames_shared_when_one, "n=1.*changed when the camera read its next frame"),
    (L.check_record_frames, frames_float_on_numpy, "has no attribute 'float'.*make a tensor of it first"),
    # batch_to
    (L.check_batch_to, to_in_place, "changed the caller's dict"),
    (L.check_batch_to, to_all_float, r"\['target'\]: expected dtype torch.int64, got torch.float32: only floating-point tensors"),
    (L.check_batch_to, to_no_cast, r"\['pixels'\]: expected dtype torch.float32, got torch.float64"),
    (L.check_batch_to, to_only_float64, r"\['scale'\]: expected dtype torch.float32, got torch.bfloat16"),
    (L.check_batch_to, to_ignoring_device, r"device=device\(type='meta'\)\)\['pixels'\] is on cpu, expected meta"),
    (L.check_batch_to, to_tensors_only, "has no 'paths', 'step': keep every entry"),
    (L.check_batch_to, to_everything, "'list' object has no attribute 'to' .only tensors have"),
    (L.check_batch_to, to_cuda, "raised RuntimeError.*no CUDA GPU here"),
    (L.check_batch_to, to_nothing, "returned the caller's dict itself"),
    (L.check_batch_to, to_through_data, r"changed the caller's tensor batch\['pixels'\]"),
    (L.check_batch_to, to_numbers_as_tensors, r"\['step'\] became a tensor"),
    # target_logits
    (L.check_target_logits, logits_bare_squeeze, r"targets of shape \(1, 4\)\): expected shape \(1, 4\), got \(4,\): squeeze\(\) without a dim also removed"),
    (L.check_target_logits, lambda lg, t: lg.gather(-1, t.unsqueeze(-1)), r"expected shape \(5,\), got \(5, 1\): gather keeps the size-1 last dimension"),
    (L.check_target_logits, logits_dim_one, r"logits of shape \(2, 5, 5\).*you gathered along dim 1.*dim=-1"),
    (L.check_target_logits, logits_arange_rows, r"\(2, 5, 5\).*raised IndexError: shape mismatch.*an arange over the rows"),
    (L.check_target_logits, lambda lg, t: lg[:, t], r"got \(5, 5\): logits\[:, targets\] pairs every row with every target"),
    (L.check_target_logits, lambda lg, t: lg.gather(-1, t), "raised RuntimeError: Index tensor must have the same number of dimensions.*a last dimension of size 1"),
    (L.check_target_logits, lambda lg, t: lg.amax(dim=-1), "the largest logit of each sample, not the logit of its target"),
    (L.check_target_logits, lambda lg, t: lg.argmax(dim=-1), r"the predicted classes \(argmax\)"),
    (L.check_target_logits, lambda lg, t: L.target_logits(lg, t).float(), r"float64, targets of shape \(\)\): expected dtype torch.float64, got torch.float32"),
    (L.check_target_logits, logits_unsqueezed_in_place, "target_logits modified its input in place"),
    (L.check_target_logits, lambda lg, t: L.target_logits(lg.softmax(-1), t), "wrong values"),
]


@pytest.mark.parametrize("check, wrong, message", WRONG, ids=lambda v: getattr(v, "exercise_name", None) if callable(v) else None)
def test_wrong_answers_name_the_fault(check, wrong, message):
    assert_names_fault(check, wrong, message)


@pytest.mark.parametrize("check", [c for c, _ in PAIRS], ids=lambda c: c.exercise_name)
def test_each_check_is_tested_enough(check):
    """The bar: at least 3 correct alternatives and 8 typical wrong answers per check."""
    assert sum(c is check for c, _ in ALTERNATIVES) >= 3
    assert sum(c is check for c, _, _ in WRONG) >= 8


def test_references_match_torch():
    """The references the checks trust agree with torch's own functions."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 3, 4, generator=g), torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    torch.testing.assert_close(L.linear(x, w, b), F.linear(x, w, b))
    a, c = torch.randn(4, 3, generator=g), torch.randn(6, 3, generator=g)
    torch.testing.assert_close(L.pairwise_sq_distances(a, c), torch.cdist(a, c) ** 2, atol=1e-5, rtol=1e-5)
    image = torch.arange(24).view(4, 6)
    assert L.image_patches(image, 2).tolist()[:2] == [[0, 1, 6, 7], [2, 3, 8, 9]]
    assert L.checkerboard(3, 5, 2).tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 0], [1, 1, 0, 0, 1]]  # the prompt's example
    logits, targets = torch.randn(2, 3, 10, generator=g), torch.randint(0, 10, (2, 3), generator=g)
    torch.testing.assert_close(L.target_logits(logits, targets), -F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(2, 3)
                               + torch.logsumexp(logits, -1))
    x = torch.randn(3, 4, 5, generator=g)
    scaled = L.minmax_scale(x, -2)
    assert torch.allclose(scaled.amin(-2), torch.zeros(3, 5)) and torch.allclose(scaled.amax(-2), torch.ones(3, 5))


def test_camera_reuses_one_array():
    camera = L.Camera(np.arange(12, dtype=np.uint8).reshape(3, 2, 2))
    first = camera.read()
    second = camera.read()
    assert first is second and second.tolist() == [[4, 5], [6, 7]] and camera.reads == 2
    camera.read()
    assert camera.read().tolist() == [[0, 1], [2, 3]]  # after the last frame, the first again


def test_plot_strides_draws_each_view_beside_its_memory():
    x = torch.arange(12)
    m = x.view(3, 4)
    fig = L.plot_strides(x, {"m": m, "m.T": m.T})
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0] == "m: shape (3, 4), stride (4, 1)" and titles[2] == "m.T: shape (4, 3), stride (1, 4)"
    assert "reads it in order" in titles[1] and "jumping 4 cells at a time" in titles[3]
    memory_of_transpose = fig.axes[3]
    read = [p for p in memory_of_transpose.patches if p.get_facecolor()[:3] == matplotlib.colors.to_rgb("tab:blue")]
    assert sorted(int(p.get_x()) for p in read) == [0, 4, 8]  # row 0 of m.T reads cells 0, 4 and 8
    matplotlib.pyplot.close(fig)
    short = torch.arange(4.0)
    fig = L.plot_strides(short, {"e": short.expand(3, 4)})
    assert fig.axes[0].get_title() == "e: shape (3, 4), stride (0, 1)" and "starts 0 cells further" in fig.axes[1].get_title()
    matplotlib.pyplot.close(fig)


def test_plot_broadcast_draws_three_panels():
    fig = L.plot_broadcast(torch.arange(3.0)[:, None], torch.arange(4.0)[None, :])
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["a: (3, 1) stretched to (3, 4)", "b: (1, 4) stretched to (3, 4)", "a + b: (3, 4)"]
    assert sum(len(ax.texts) for ax in fig.axes) == 3 * 12
    matplotlib.pyplot.close(fig)


def test_checks_do_not_trust_close_values_for_exact_answers():
    """Exact answers are compared exactly: a checkerboard off by a rounding error fails."""
    assert_names_fault(L.check_checkerboard, lambda h, w, s: L.checkerboard(h, w, s) + 1e-3, "wrong values")
