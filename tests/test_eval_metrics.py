"""Every evaluation metric against small hand-computed cases; faiss against brute force."""
import numpy as np
import pytest
import torch

from rayvl.eval.knn import top_k
from rayvl.eval.linear_probe import (DECAY_GRID, NotProbed, ProbeSettings, ProbeTrain, clip_benchmark_probe,
                                     linear_probe, split_indices, trained_layer)
from rayvl.eval.paraphrase import average_overlap, expand_queries, jaccard, paraphrase_metrics
from rayvl.eval.retrieval import retrieval_metrics, retrieval_metrics_bruteforce
from rayvl.eval.sts import read_sts, sts_metrics
from rayvl.eval.zeroshot import average_precision, zeroshot_metrics


def test_average_overlap_and_jaccard_by_hand():
    # d=1: {1}∩{2}=0; d=2: {1,2}∩{2,1}=2 → 2/2; d=3: {1,2,3}∩{2,1,4}=2 → 2/3
    assert average_overlap([1, 2, 3], [2, 1, 4], 3) == pytest.approx((0 + 1 + 2 / 3) / 3)
    assert jaccard([1, 2, 3], [2, 1, 4], 3) == pytest.approx(2 / 4)
    assert average_overlap([5, 6, 7], [5, 6, 7], 3) == 1.0 and jaccard([5, 6, 7], [7, 6, 5], 3) == 1.0
    assert average_overlap([1, 2, 3], [4, 5, 6], 3) == 0.0 and jaccard([1, 2, 3], [4, 5, 6], 3) == 0.0
    # same set, reversed order: JS is order-blind, AO is top-weighted
    assert jaccard([1, 2], [2, 1], 2) == 1.0 and average_overlap([1, 2], [2, 1], 2) == pytest.approx(0.5)


def test_paraphrase_metrics_on_a_gallery():
    gallery = np.eye(4, dtype=np.float32)
    q = np.array([[1, 0.5, 0.2, 0], [0, 0, 1, 0.1]], np.float32)
    p = np.array([[1, 0.5, 0.2, 0], [0, 1, 0, 0.5]], np.float32)  # pair 1 identical, pair 2 disagrees at the top
    # rankings: q1=p1=[0,1,2,3]; q2=[2,3,0,1] vs p2=[1,3,0,2]
    r = paraphrase_metrics(gallery, q, p, k=2)
    ao2 = (0 / 1 + 1 / 2) / 2  # d=1: {2}∩{1}=0; d=2: {2,3}∩{1,3}=1 → 1/2
    assert r["paraphrase_AO@2"] == pytest.approx(100 * (1 + ao2) / 2)
    assert r["paraphrase_JS@2"] == pytest.approx(100 * (1 + 1 / 3) / 2)


def test_the_paraphrase_task_ranks_each_distinct_image_once():
    """A photo stored under two keys (COCO-style shards) is one image of the ranked lists, as in retrieval: the task
    scores what paraphrase_metrics gives over the distinct images, where the per-row gallery gives other numbers."""
    from rayvl.eval.data import EvalData
    from rayvl.eval.tasks import paraphrase

    rows = np.array([[1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], np.float32)
    texts = {"q": [1, 0.5, 0.2, 0], "p": [1, 0.2, 0.5, 0]}

    class Texts:
        def texts(self, names):
            return np.array([texts[t] for t in names], np.float32)

    data = EvalData(np.zeros((5, 3, 2, 2), np.uint8), 5, np.full(5, -1), gallery=np.array([0, 2, 3, 4]),
                    paraphrases=[{"caption": "q", "paraphrase": "p"}])
    scored = paraphrase(data, {"image": rows}, Texts(), 2)
    distinct = paraphrase_metrics(rows[[0, 2, 3, 4]], Texts().texts(["q"]), Texts().texts(["p"]), 2)
    assert scored == distinct and scored["paraphrase_JS@2"] == pytest.approx(100 / 3)
    assert paraphrase_metrics(rows, Texts().texts(["q"]), Texts().texts(["p"]), 2) != distinct


def test_query_expansion_is_eq5_average():
    q = np.array([[1.0, 0.0]])
    e = np.array([[[0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]])
    z = expand_queries(q, e)  # (q + Σe)/(K+1) = (2, 2)/4 → normalised
    np.testing.assert_allclose(z, [[2 ** -0.5, 2 ** -0.5]])


def test_recall_with_several_captions_per_image():
    img = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1]], np.float32)
    txt = np.array([[0.9, 0.1, 0], [0.6, 0.8, 0], [0.1, 0.9, 0], [0.7, 0, 0.3], [0.8, 0.6, 0]], np.float32)
    owner = np.array([0, 0, 1, 2, 1])
    r = retrieval_metrics(img, txt, owner, ks=(1, 2))
    # t2i top-1: t0→img0 ✓, t1→img1 ✗, t2→img1 ✓, t3→img0 ✗, t4→img0 ✗ ; top-2 adds t1 ✓, t3 (img0, img2) ✓, t4 ✓
    assert r["t2i_R@1"] == pytest.approx(40.0) and r["t2i_R@2"] == pytest.approx(100.0)
    # i2t top-1: img0→t0 (own) ✓; img1→t2 (own) ✓; img2→t3 (own) ✓
    assert r["i2t_R@1"] == pytest.approx(100.0)
    bf = retrieval_metrics_bruteforce(img, txt, owner, ks=(1, 2))
    assert all(bf[k] == pytest.approx(r[k]) for k in bf)


def test_faiss_agrees_with_bruteforce():
    rng = np.random.default_rng(0)
    img = rng.normal(size=(200, 16)).astype(np.float32)
    txt = rng.normal(size=(500, 16)).astype(np.float32)
    owner = rng.integers(0, 200, size=500)
    owner[:200] = np.arange(200)  # every image has at least one caption
    fast, slow = retrieval_metrics(img, txt, owner), retrieval_metrics_bruteforce(img, txt, owner)
    assert all(fast[k] == pytest.approx(slow[k]) for k in slow)
    scores, idx = top_k(img, txt[:7], 5)
    ref = np.argsort(-(txt[:7] @ img.T), axis=1)[:, :5]
    np.testing.assert_array_equal(idx, ref)


def test_zeroshot_per_class_recall_by_hand():
    classes = torch.eye(3)
    images = torch.tensor([[1, 0, 0], [1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1.0]])
    labels = torch.tensor([0, 0, 1, 1, 2])  # predictions 0,0,1,0,2 → class recalls 1, 1/2, 1
    r = zeroshot_metrics(images, labels, classes)
    assert r["zeroshot_top1"] == pytest.approx(80.0)
    assert r["zeroshot_mean_per_class_recall"] == pytest.approx(100 * (1 + 0.5 + 1) / 3)
    assert r["zeroshot_chance_top1"] == pytest.approx(100 / 3)


def test_average_precision_by_hand():
    """Class 0: positives ranked 1st and 3rd → (1/1 + 2/3) / 2; class 1: its one positive last of 4 → 1/4; class 2
    has none → 0 (CLIP_benchmark averages it in)."""
    scores = np.array([[0.9, 0.1, 0.5], [0.8, 0.2, 0.4], [0.7, 0.3, 0.3], [0.6, 0.0, 0.2]])
    targets = np.array([[1, 0, 0], [0, 0, 0], [1, 0, 0], [0, 1, 0]])
    np.testing.assert_allclose(average_precision(scores, targets), [(1 + 2 / 3) / 2, 1 / 4, 0.0], rtol=0, atol=1e-15)


def test_sts_metrics_and_reader(tmp_path):
    f = tmp_path / "sts.tsv"
    f.write_text("sentence1\tsentence2\tscore\na\tb\t1.0\nc\td\t3.0\ne\tf\t2.0\nbroken row\n")
    s1, s2, gold = read_sts(f)
    assert s1 == ["a", "c", "e"] and gold.tolist() == [1.0, 3.0, 2.0]
    e1 = np.array([[1, 0], [1, 0], [1, 0]], float)
    e2 = np.array([[0.2, 1], [1, 0.1], [1, 0.6]], float)  # cosines rise with gold: 1 < 2 < 3
    r = sts_metrics(e1, e2, gold)
    assert r["sts_spearman"] == pytest.approx(100.0)
    cos = np.array([0.2 / np.hypot(0.2, 1), 1 / np.hypot(1, 0.1), 1 / np.hypot(1, 0.6)])
    assert r["sts_pearson"] == pytest.approx(100 * np.corrcoef(cos, gold)[0, 1])


def test_linear_probe_separable_and_stratified():
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(4), 50)
    x = rng.normal(size=(200, 8)) + 4 * np.eye(4, 8)[y]
    tr, va, te = split_indices(y)
    assert len(set(tr) | set(va) | set(te)) == 200 and not (set(tr) & set(te))
    assert np.bincount(y[te]).tolist() == [10, 10, 10, 10]
    r = linear_probe(x[tr], y[tr], x[va], y[va], x[te], y[te])
    assert r["linear_probe_top1"] > 95 and r["linear_probe_C"] in (0.01, 0.1, 1.0, 10.0, 100.0)
    assert r["linear_probe_chance_top1"] == 25.0


def test_clip_benchmarks_probe_layer_is_adamw_on_a_cosine_schedule_against_float64():
    """The layer CLIP_benchmark's ``train`` fits — torch.manual_seed(seed), the layer built, shuffled batches from
    that RNG each epoch, AdamW (decoupled decay, bias-corrected moments), the learning rate
    0.5 (1 + cos(π t / T)) · lr before step t — equals that loop written out in float64, 3 batches an epoch."""
    rng = np.random.default_rng(1)
    x, y = torch.tensor(rng.normal(size=(12, 5)), dtype=torch.float32), torch.tensor(rng.integers(0, 3, 12))
    s = ProbeSettings(epochs=4, lr=0.1, batch_size=5, seed=7)
    before = torch.random.get_rng_state()
    layer = trained_layer(x, y, 3, 0.01, s)
    assert torch.equal(torch.random.get_rng_state(), before)  # the process's RNG as it was
    torch.manual_seed(7)
    start = torch.nn.Linear(5, 3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.double(), y), batch_size=5, shuffle=True)
    params = [start.weight.detach().double(), start.bias.detach().double()]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps, t = s.epochs * len(loader), 0
    for _ in range(s.epochs):
        for batch_x, batch_y in loader:
            t += 1
            lr = 0.5 * (1 + np.cos(np.pi * (t - 1) / steps)) * s.lr
            w, b = (p.clone().requires_grad_() for p in params)
            torch.nn.functional.cross_entropy(batch_x @ w.T + b, batch_y).backward()
            for i, (p, g) in enumerate(zip(params, (w.grad, b.grad))):
                m[i] = 0.9 * m[i] + 0.1 * g
                v[i] = 0.999 * v[i] + 0.001 * g * g
                p.mul_(1 - lr * 0.01).sub_(lr * (m[i] / (1 - 0.9 ** t)) / ((v[i] / (1 - 0.999 ** t)).sqrt() + 1e-8))
    assert t == 12
    assert torch.allclose(layer.weight.double(), params[0], atol=1e-5)
    assert torch.allclose(layer.bias.double(), params[1], atol=1e-5)
    assert torch.equal(trained_layer(x, y, 3, 0.01, s).weight, layer.weight)  # seeded: the same layer again


def _clusters(n_per_class: int, classes: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(classes), n_per_class)
    return (rng.normal(size=(len(y), 16)) * 0.3 + 3 * np.eye(classes, 16)[y]).astype(np.float32), y


def test_clip_benchmarks_probe_scores_trains_on_k_shots_and_searches_the_decay_on_a_validation_share():
    x, y = _clusters(20)
    test_x, test_y = _clusters(5, seed=1)
    train_y = y.copy()
    train_y[:3] = -1  # images without a class are left out
    r = clip_benchmark_probe(ProbeTrain(x, train_y, ProbeSettings()), test_x, test_y)
    assert (r["linear_probe_top1"], r["linear_probe_top5"], r["linear_probe_mean_per_class_recall"]) == (100, 100, 100)
    assert (r["linear_probe_train"], r["linear_probe_test"], r["linear_probe_weight_decay"]) == (117, 30, 0.0)
    assert r["linear_probe_chance_top1"] == pytest.approx(100 / 6) and r["linear_probe_protocol"] == "clip_benchmark"
    few = clip_benchmark_probe(ProbeTrain(x, y, ProbeSettings(fewshot_k=2)), test_x, test_y)
    assert few["linear_probe_train"] == 12 and few["linear_probe_fewshot_k"] == 2
    with pytest.raises(ValueError, match=r"--fewshot-k 21: the train split has fewer than 21 images of class"):
        clip_benchmark_probe(ProbeTrain(x, y, ProbeSettings(fewshot_k=21)), test_x, test_y)
    searched = clip_benchmark_probe(ProbeTrain(x, y, ProbeSettings(val_proportion=0.25)), test_x, test_y)
    assert searched["linear_probe_weight_decay"] in DECAY_GRID and searched["linear_probe_train"] == 120
    assert searched["linear_probe_top1"] == 100
    # few-shot with a validation share (CLIP_benchmark's order): the split first, 2 shots a class from its train
    # part, the decay searched on its whole validation part, the layer fitted to the 12 shots alone
    both = clip_benchmark_probe(ProbeTrain(x, y, ProbeSettings(fewshot_k=2, val_proportion=0.25)), test_x, test_y)
    assert both["linear_probe_train"] == 12 and both["linear_probe_weight_decay"] in DECAY_GRID
    with pytest.raises(NotProbed, match="has no image with a class"):
        clip_benchmark_probe(ProbeTrain(x, np.full_like(y, -1), ProbeSettings()), test_x, test_y)
    # four classes: no top-5 (CLIP_benchmark reports it past 5 classes)
    x4, y4 = _clusters(10, classes=4)
    assert "linear_probe_top5" not in clip_benchmark_probe(ProbeTrain(x4, y4, ProbeSettings()), x4, y4)
    for bad in (dict(fewshot_k=0), dict(epochs=0), dict(val_proportion=1.0)):
        with pytest.raises(ValueError):
            ProbeSettings(**bad).check()
