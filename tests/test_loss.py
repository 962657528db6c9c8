"""The gathered contrastive loss equals a float64 full-batch reference — in one process and with 2 Ray workers — and
so does the loss a report carries (the mean over ranks)."""
import json

import numpy as np
import pytest
import torch

from conftest import two_rank_files
from rayvl.losses import clip_loss, label_aware_loss, siglip_loss


def reference_clip_loss(img: np.ndarray, txt: np.ndarray, scale: float) -> float:
    """CLIP's symmetric InfoNCE over the whole global batch, written out in float64 numpy."""
    logits = scale * img @ txt.T

    def ce_rows(m):
        m = m - m.max(1, keepdims=True)
        logp = m - np.log(np.exp(m).sum(1, keepdims=True))
        return -np.mean(np.diag(logp))

    return 0.5 * (ce_rows(logits) + ce_rows(logits.T))


def reference_unicl_loss(img_q, txt_q, img_k, txt_k, labels_q, labels_k, scale) -> float:
    """[UniCL] eq. (2)–(3) in float64 numpy: each query's mean −log softmax over its positives (same label
    among the keys), averaged over queries, the two directions averaged."""
    def side(q, k):
        logits = scale * q @ k.T
        m = logits.max(1, keepdims=True)
        logp = logits - m - np.log(np.exp(logits - m).sum(1, keepdims=True))
        pos = labels_q[:, None] == labels_k[None, :]
        return np.mean(-(logp * pos).sum(1) / pos.sum(1))

    return 0.5 * (side(img_q, txt_k) + side(txt_q, img_k))


def reference_siglip_loss(img: np.ndarray, txt: np.ndarray, scale: float, bias: float, labels: np.ndarray) -> float:
    """SigLIP (Zhai et al. 2023, Algorithm 1) over the whole global batch in float64 numpy: −Σ_ij log σ(z_ij (t x·y +
    b)) / n, z_ij = +1 where the rows' labels agree (the diagonal for unique labels), −1 elsewhere."""
    logits = scale * img @ txt.T + bias
    z = np.where(labels[:, None] == labels[None, :], 1.0, -1.0)
    return float(np.sum(np.logaddexp(0.0, -z * logits)) / len(img))  # −log σ(x) = log(1 + e^−x)


def _features(seed, n, d):
    g = torch.Generator().manual_seed(seed)
    img = torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)
    txt = torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)
    return img, txt


def test_single_process_matches_reference():
    img, txt = _features(0, 12, 7)
    loss = clip_loss(img, txt, torch.tensor(9.5, dtype=torch.float64))
    assert loss.item() == pytest.approx(reference_clip_loss(img.numpy(), txt.numpy(), 9.5), rel=1e-12)


def test_siglip_matches_float64_reference_with_unique_and_shared_labels():
    img, txt = _features(3, 12, 7)
    unique = -1 - torch.arange(12)
    shared = torch.tensor([0, 0, 1, 2, 2, 2, -1, -2, 3, 3, -3, -4])  # several rows of one pair (TOnICS's objects)
    for labels in (unique, shared):
        got = siglip_loss(img, txt, torch.tensor(10.0, dtype=torch.float64), torch.tensor(-10.0, dtype=torch.float64),
                          labels)
        ref = reference_siglip_loss(img.numpy(), txt.numpy(), 10.0, -10.0, labels.numpy())
        assert got.item() == pytest.approx(ref, rel=1e-12)
    # the paper's init on random features: the bias makes every pair start near "no match", σ(−10 ± 10)
    assert siglip_loss(img, txt, torch.tensor(10.0, dtype=torch.float64), torch.tensor(-10.0, dtype=torch.float64),
                       unique).item() < siglip_loss(img, txt, torch.tensor(10.0, dtype=torch.float64),
                                                    torch.tensor(0.0, dtype=torch.float64), unique).item()


def test_unicl_with_unique_labels_is_clip_exactly():
    img, txt = _features(3, 16, 8)
    scale = torch.tensor(11.0, dtype=torch.float64)
    unique = torch.arange(16) * 7 - 50  # any distinct labels
    assert label_aware_loss(img, txt, scale, unique).item() == pytest.approx(clip_loss(img, txt, scale).item(),
                                                                          rel=1e-13)


def test_unicl_repeated_labels_and_queue_match_float64_reference():
    img, txt = _features(4, 12, 8)
    labels = torch.tensor([0, 1, 0, 2, 1, 0, -1, -2, -3, 2, -4, -5])  # classes 0–2 repeat; pairs unique (< 0)
    got = label_aware_loss(img, txt, torch.tensor(9.0, dtype=torch.float64), labels)
    ref = reference_unicl_loss(img.numpy(), txt.numpy(), img.numpy(), txt.numpy(), labels.numpy(), labels.numpy(), 9)
    assert got.item() == pytest.approx(ref, rel=1e-12)
    assert got.item() != pytest.approx(clip_loss(img, txt, torch.tensor(9.0, dtype=torch.float64)).item())

    # queue keys with labels (memory bank): positives are found in the queue too
    q_img, q_txt = _features(5, 20, 8)
    q_labels = torch.tensor([0, 5, 1, -9, 2, 0, 7, -10, 1, 1, 3, -11, 0, 2, 4, -12, 6, 0, -13, 8])
    keys_img, keys_txt = torch.cat([img, q_img]), torch.cat([txt, q_txt])
    key_labels = torch.cat([labels, q_labels])
    got = label_aware_loss(img, txt, torch.tensor(50.0, dtype=torch.float64), labels, image_keys=keys_img,
                     text_keys=keys_txt, key_labels=key_labels)
    ref = reference_unicl_loss(img.numpy(), txt.numpy(), keys_img.numpy(), keys_txt.numpy(), labels.numpy(),
                               key_labels.numpy(), 50.0)
    assert got.item() == pytest.approx(ref, rel=1e-12)


# the two-worker check's global batch: seed, rows, dimension, logit scale, and labels with positives shared across
# the two ranks' halves
SEED, N, D, SCALE = 1, 10, 6, 7.0
LABELS = [3, 1, 3, -1, 1, 3, -2, -3, 1, -4]


def two_ranks(out: str) -> None:
    """Each of 2 Ray Train ranks (conftest.two_rank_checks): its half's losses and gradients, and the means over
    ranks."""
    import ray.train
    import torch.distributed as dist

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    img, txt = _features(SEED, N, D)  # same global batch on every rank
    b = N // world
    mine_img = img[rank * b:(rank + 1) * b].clone().requires_grad_(True)
    mine_txt = txt[rank * b:(rank + 1) * b].clone().requires_grad_(True)
    loss = clip_loss(mine_img, mine_txt, torch.tensor(SCALE, dtype=torch.float64), gather_with_grad=True)
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    labels = torch.tensor(LABELS)[rank * b:(rank + 1) * b]
    unicl = label_aware_loss(mine_img.detach(), mine_txt.detach(), torch.tensor(SCALE, dtype=torch.float64),
                       labels).detach()
    dist.all_reduce(unicl)
    # SigLIP on its own leaves, with the shared labels: positives across the two ranks' rows
    sig_img, sig_txt = mine_img.detach().clone().requires_grad_(True), mine_txt.detach().clone().requires_grad_(True)
    siglip = siglip_loss(sig_img, sig_txt, torch.tensor(SCALE, dtype=torch.float64),
                         torch.tensor(-3.0, dtype=torch.float64), labels)
    siglip.backward()
    mean_siglip = siglip.detach().clone()
    dist.all_reduce(mean_siglip)
    # what a report says: the loss of the steps since the last one, over ranks (train/window.py)
    from rayvl.train.window import Window

    window = Window(steps=1)
    window.add(loss.item(), 0.0, {"image": mine_img, "label": labels}, world)
    reported = window.over_ranks("cpu")["loss"]
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"loss": loss.item(), "mean_loss": mean_loss.item() / world, "unicl": unicl.item() / world,
                   "reported": reported, "siglip": mean_siglip.item() / world, "siglip_grad_img": sig_img.grad.tolist(),
                   "siglip_grad_txt": sig_txt.grad.tolist(),
                   "grad_img": mine_img.grad.tolist(), "grad_txt": mine_txt.grad.tolist()}, f)


def test_two_ray_workers_match_float64_reference(two_rank_checks):
    n, d, scale, world, labels = N, D, SCALE, 2, LABELS
    folder = two_rank_files(two_rank_checks, __name__)
    img, txt = _features(SEED, n, d)
    ref = reference_clip_loss(img.numpy(), txt.numpy(), scale)
    # float64 reference gradient of the global loss
    gi, gt = img.clone().requires_grad_(True), txt.clone().requires_grad_(True)
    logits = scale * gi @ gt.T
    target = torch.arange(n)
    full = 0.5 * (torch.nn.functional.cross_entropy(logits, target)
                  + torch.nn.functional.cross_entropy(logits.T, target))
    full.backward()
    assert full.item() == pytest.approx(ref, rel=1e-12)
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]
    b = n // world
    unicl_ref = reference_unicl_loss(img.numpy(), txt.numpy(), img.numpy(), txt.numpy(), np.array(labels),
                                     np.array(labels), scale)
    for r, out in enumerate(ranks):
        assert out["mean_loss"] == pytest.approx(ref, rel=1e-10)
        assert out["reported"] == pytest.approx(ref, rel=1e-10)  # the metrics' loss is the global one, not rank r's
        assert out["unicl"] == pytest.approx(unicl_ref, rel=1e-10)  # labels gathered with the features
        # each rank's own-feature gradient collects every rank's loss terms (gather with grad); data-parallel
        # averaging over ranks divides by world, giving exactly the global loss's gradient
        np.testing.assert_allclose(np.array(out["grad_img"]) / world, gi.grad[r * b:(r + 1) * b].numpy(),
                                   rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(np.array(out["grad_txt"]) / world, gt.grad[r * b:(r + 1) * b].numpy(),
                                   rtol=1e-9, atol=1e-12)
    assert ranks[0]["loss"] != pytest.approx(ranks[1]["loss"])  # local losses differ; only their mean is global

    # SigLIP: the mean over ranks is the global batch's loss, and so are the averaged gradients
    si, st = img.clone().requires_grad_(True), txt.clone().requires_grad_(True)
    logits = scale * si @ st.T - 3.0
    z = torch.where(torch.tensor(labels)[:, None] == torch.tensor(labels)[None, :], 1.0, -1.0).double()
    global_siglip = -torch.nn.functional.logsigmoid(z * logits).sum() / n
    global_siglip.backward()
    assert global_siglip.item() == pytest.approx(
        reference_siglip_loss(img.numpy(), txt.numpy(), scale, -3.0, np.array(labels)), rel=1e-12)
    for r, out in enumerate(ranks):
        assert out["siglip"] == pytest.approx(global_siglip.item(), rel=1e-10)
        np.testing.assert_allclose(np.array(out["siglip_grad_img"]) / world, si.grad[r * b:(r + 1) * b].numpy(),
                                   rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(np.array(out["siglip_grad_txt"]) / world, st.grad[r * b:(r + 1) * b].numpy(),
                                   rtol=1e-9, atol=1e-12)
