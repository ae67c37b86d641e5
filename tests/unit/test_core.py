"""FedAvg arithmetic, faults, sampling, local update, pool sizing: the pure core, no Ray."""
import numpy as np
import pytest
import torch

from dpfl_ray import rng as R
from dpfl_ray.algorithms import FedAvg, RoundOutcome, weighted_sum
from dpfl_ray.errors import DPFLError
from dpfl_ray.faults.plan import num_tail_drops, plan_round
from dpfl_ray.training.local import local_update
from dpfl_ray.training.model_inputs import check_model_input
from dpfl_ray.training.models import (build_model, combine_shards, eval_shards, evaluate, get_flat, initial_theta,
                                      model_file, model_file_bytes, set_flat, shard_sums)
from dpfl_ray.runtime.resources import (TRIAL_HEAD_CPU, assign_clients, deal, plan_pool, trial_bundles, trial_workers,
                                        trials_that_fit, undeal)
from dpfl_ray.privacy.client_sampling import sample_clients
from dpfl_ray.scenario import DropoutConfig, ModelConfig, ResourcesConfig, SamplingConfig


def test_fedavg_is_the_weighted_mean():
    ups = {3: np.array([1.0, 0.0], np.float32), 1: np.array([0.0, 4.0], np.float32)}
    w = np.array([0, 0.5, 0, 1.0])
    agg = FedAvg(weights=w).finish(RoundOutcome(0, tuple(ups), updates=ups), 2)
    np.testing.assert_allclose(agg.delta, [1.0 / 1.5, 2.0 / 1.5], rtol=1e-6)
    assert agg.weight_sum == 1.5


def test_fedavg_without_survivors_does_not_move():
    agg = FedAvg(weights=np.ones(3)).finish(RoundOutcome(0, (), updates={}), 5)
    assert agg.weight_sum == 0 and not agg.delta.any()


def test_weighted_sum_is_independent_of_arrival_order():
    rng = np.random.default_rng(0)
    ups = {i: rng.normal(size=1000).astype(np.float32) for i in range(50)}
    w = rng.random(50)
    a, _ = weighted_sum(ups, w)
    b, _ = weighted_sum(dict(reversed(list(ups.items()))), w)
    assert np.array_equal(a, b)


def test_tail_dropout_drops_the_last_reporters():
    cfg = DropoutConfig(model="tail", rate=0.3, phase="upload")
    plan = plan_round(cfg, np.arange(10), seed=1, round_idx=4)
    assert len(plan.dropped) == 3 and set(plan.dropped.values()) == {"upload"}
    assert set(plan.dropped) == set(plan.report_order[-3:])
    assert len(plan.survivors(range(10))) == 7
    assert plan_round(cfg, np.arange(10), 1, 4) == plan  # drawn from the seed
    assert num_tail_drops(0.1, 50) == 5 and num_tail_drops(0.3, 7) == 2


def test_bernoulli_dropout_rate():
    cfg = DropoutConfig(model="bernoulli", rate=0.2, phase="training")
    drops = sum(len(plan_round(cfg, np.arange(100), 0, t).dropped) for t in range(200))
    assert abs(drops / 20000 - 0.2) < 0.015  # ~5 standard deviations


def test_sampling_fixed_and_poisson():
    fixed = SamplingConfig(mode="fixed", clients_per_round=10)
    s = sample_clients(fixed, 100, 0, 3)
    assert len(s) == 10 and len(set(s)) == 10 and list(s) == sorted(s)
    assert np.array_equal(s, sample_clients(fixed, 100, 0, 3))
    assert not np.array_equal(s, sample_clients(fixed, 100, 0, 4))
    pois = SamplingConfig(mode="poisson", rate=0.01, clients_per_round=None)
    sizes = [len(sample_clients(pois, 5000, 0, t)) for t in range(200)]
    assert abs(np.mean(sizes) - 50) < 3


def test_streams_differ_by_purpose_round_and_client():
    draws = {R.generator(0, p, r, c).integers(1 << 62) for p in ("sample", "noise") for r in (0, 1) for c in (0, 1)}
    assert len(draws) == 8


def _data(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, n)


def test_local_update_is_deterministic_and_clipped():
    torch.set_num_threads(1)
    model = build_model(ModelConfig(name="cnn"), (1, 28, 28), 10, seed=0)
    theta = get_flat(model)
    x, y = _data()
    kw = dict(epochs=1, batch_size=10, lr=0.5, torch_seed=1)
    d1 = local_update(model, theta, x, y, clip_norm=None, rng=np.random.default_rng(1), **kw)
    d2 = local_update(model, theta, x, y, clip_norm=None, rng=np.random.default_rng(1), **kw)
    assert np.array_equal(d1, d2) and np.linalg.norm(d1) > 0.05
    dc = local_update(model, theta, x, y, clip_norm=0.05, rng=np.random.default_rng(1), **kw)
    assert np.linalg.norm(dc) <= 0.05 * (1 + 1e-5)


def test_local_update_reduces_loss():
    model = build_model(ModelConfig(name="logistic"), (8,), 2, seed=0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    theta = get_flat(model)
    delta = local_update(model, theta, x, y, epochs=5, batch_size=10, lr=0.5, clip_norm=None,
                         rng=rng, torch_seed=0)
    set_flat(model, theta + delta)
    with torch.no_grad():
        acc = (model(torch.from_numpy(x)).argmax(1).numpy() == y).mean()
    assert acc > 0.9


def test_models_init_from_seed():
    a = get_flat(build_model(ModelConfig(name="mlp"), (1, 8, 8), 10, 7))
    b = get_flat(build_model(ModelConfig(name="mlp"), (1, 8, 8), 10, 7))
    c = get_flat(build_model(ModelConfig(name="mlp"), (1, 8, 8), 10, 8))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    with pytest.raises(DPFLError, match="model.name"):
        build_model(ModelConfig(name="cnn"), (1, 8, 8), 10, 0)


@pytest.mark.parametrize("name, shape", [("cnn", (1, 28, 28)), ("mlp", (1, 8, 8)), ("logistic", (6,))])
def test_a_model_file_is_the_seeded_model_s_with_theta_and_draws_nothing_from_torch(name, shape):
    """model_file_bytes makes its layers on the meta device: the same bytes as the seeded model given
    theta, and torch's global generator left where it was (a worker answers it beside training)."""
    cfg = ModelConfig(name=name)
    model = build_model(cfg, shape, 10, 4)
    theta = get_flat(model) * np.float32(-2.0)
    set_flat(model, theta)
    torch.manual_seed(11)
    blob = model_file_bytes(cfg, shape, 10, theta)
    drawn = torch.rand(4)
    torch.manual_seed(11)
    assert torch.equal(drawn, torch.rand(4))
    assert blob == model_file(model.state_dict())


@pytest.mark.parametrize("channels", [1, 3])
def test_the_cnn_sizes_its_dense_layer_as_its_features_give_for_any_image(channels):
    """The cnn's first dense layer is sized from its layers' arithmetic, not by a forward pass (on the
    meta device, where model_file_bytes builds it, one loads torch's compiler): the same size as one."""
    from dpfl_ray.training.models import TFPrivacyCNN

    for height in range(16, 71, 3):
        for width in (16, 28, 31, 64):
            cnn = TFPrivacyCNN(channels, height, width, 10)
            with torch.no_grad():
                probed = cnn.features(torch.zeros(1, channels, height, width)).shape[1]
            assert cnn.classifier[0].in_features == probed, (channels, height, width)


@pytest.mark.parametrize("layer", [torch.nn.MaxPool2d(2, 1, ceil_mode=True), torch.nn.Conv2d(1, 2, 3, padding="same"),
                                   torch.nn.BatchNorm2d(1)])
def test_a_layer_without_a_size_rule_is_refused_rather_than_sized_wrong(layer):
    from dpfl_ray.training.models import _flat_size

    with pytest.raises(TypeError, match="no size rule"):
        _flat_size(torch.nn.Sequential(torch.nn.Conv2d(1, 1, 3), layer), 1, 28, 28)


def test_a_model_file_of_the_cnn_loads_no_compiler():
    """A run's model.pt (model_file_bytes, on the meta device) loaded torch._dynamo and sympy, about a
    second of CPU in the worker that writes it: through the cnn's probe forward pass and to_empty."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from dpfl_ray.scenario import ModelConfig\n"
            "from dpfl_ray.training.models import initial_theta, model_file_bytes\n"
            "cfg = ModelConfig(name='cnn')\n"
            "assert model_file_bytes(cfg, (1, 28, 28), 10, initial_theta(cfg, (1, 28, 28), 10, 0))\n"
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def test_a_flat_model_of_another_size_gets_no_model_file_and_says_both_sizes():
    """A checkpoint's theta of another model (edited or foreign) reached torch's view() when a resumed
    run that failed wrote model.pt from it: an internal error. Now one line with both sizes."""
    cfg = ModelConfig(name="logistic")
    with pytest.raises(DPFLError, match=r"model: a flat model of 100 values does not fit this scenario's logistic "
                                        r"\(70 values\): a checkpoint of another model\?"):
        model_file_bytes(cfg, (6,), 10, np.zeros(100, np.float32))


def test_a_model_with_buffers_gets_no_model_file_and_torch_s_generator_is_left_alone(monkeypatch):
    """theta holds parameters only: a model with buffers (none is shipped) is refused, naming them,
    instead of being built from the seed, which would seed the global generator under training."""
    from dpfl_ray.training import models

    monkeypatch.setattr(models, "_layers", lambda cfg, shape, n: torch.nn.Sequential(
        torch.nn.Linear(shape[0], n), torch.nn.BatchNorm1d(n)))
    torch.manual_seed(11)
    with pytest.raises(DPFLError, match=r"has buffers \(1.running_mean, 1.running_var, 1.num_batches_tracked\)"):
        model_file_bytes(ModelConfig(name="logistic"), (6,), 3, np.zeros(27, np.float32))
    drawn = torch.rand(4)
    torch.manual_seed(11)
    assert torch.equal(drawn, torch.rand(4))


def test_set_flat_copies_instead_of_aliasing():
    model = build_model(ModelConfig(name="logistic"), (4,), 2, 0)
    flat = np.zeros(get_flat(model).size, np.float32)
    flat.setflags(write=False)
    set_flat(model, flat)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert not flat.any()


def test_pool_plan():
    auto = ResourcesConfig(workers="auto", num_cpus_per_worker=1)
    assert plan_pool(auto, {"CPU": 2}, 100).workers == 2
    assert plan_pool(auto, {"CPU": 16}, 5).workers == 5
    gpu = ResourcesConfig(workers="auto", num_cpus_per_worker=0, num_gpus_per_worker=0.25)
    assert plan_pool(gpu, {"CPU": 2, "GPU": 2}, 100).workers == 8
    with pytest.raises(DPFLError, match="num_gpus_per_worker"):
        plan_pool(gpu, {"CPU": 2}, 100)
    with pytest.raises(DPFLError, match="resources.workers"):  # would queue forever in Ray
        plan_pool(ResourcesConfig(workers=4, num_cpus_per_worker=1), {"CPU": 2}, 100)
    assert plan_pool(ResourcesConfig(workers=4, num_cpus_per_worker=0.5), {"CPU": 2}, 100).workers == 4
    # workers that reserve nothing all start at once: a few a CPU, not 100 on 2 CPUs (the coordinator was lost)
    unreserved = ResourcesConfig(workers=100, num_cpus_per_worker=0)
    with pytest.raises(DPFLError, match=r"resources.workers: 100 workers that reserve no CPU or GPU on a cluster "
                                        r"of 2 CPUs: at most 8"):
        plan_pool(unreserved, {"CPU": 2}, 1000)
    assert plan_pool(unreserved, {"CPU": 32}, 1000).workers == 100
    assert plan_pool(ResourcesConfig(workers=8, num_cpus_per_worker=0), {"CPU": 2}, 1000).workers == 8


def test_a_sweep_trial_reserves_a_head_bundle_and_one_bundle_per_worker():
    head = {}  # the trial's driver and coordinator reserve nothing, as in `dpfl run`
    auto = ResourcesConfig(workers="auto", num_cpus_per_worker=1)
    # auto shares what `dpfl run` would fill among the trials that run side by side
    assert [trial_workers(auto, 100, {"CPU": 2}, k) for k in (1, 2, 8)] == [2, 1, 1]
    assert [trial_workers(auto, 100, {"CPU": 16}, k) for k in (1, 3, 8)] == [16, 5, 2]
    assert trial_workers(auto, 3, {"CPU": 16}, 1) == 3  # never more workers than clients
    gpu = ResourcesConfig(workers=3, num_cpus_per_worker=0.5, num_gpus_per_worker=0.25)
    assert [trial_workers(gpu, 100, {"CPU": 2, "GPU": 1}, k) for k in (1, 8)] == [3, 3]
    assert trial_workers(gpu, 2, {"CPU": 2, "GPU": 1}, 1) == 2
    with pytest.raises(DPFLError, match="resources.workers"):  # Tune would wait for the bundles forever
        trial_workers(ResourcesConfig(workers=4, num_cpus_per_worker=1), 100, {"CPU": 2}, 1)
    assert trial_bundles(auto, 1) == [head, {"CPU": 1.0}]
    assert trial_bundles(gpu, 3) == [head] + [{"CPU": 0.5, "GPU": 0.25}] * 3
    assert trial_bundles(ResourcesConfig(workers=2, num_cpus_per_worker=0), 2) == [{"CPU": TRIAL_HEAD_CPU}]
    # how many trials fit at once: the scarcest resource decides
    assert trials_that_fit({"CPU": 2}, trial_bundles(auto, 1)) == 2
    assert trials_that_fit({"CPU": 2}, trial_bundles(ResourcesConfig(num_cpus_per_worker=0.5), 1)) == 4
    assert trials_that_fit({"CPU": 16, "GPU": 1}, trial_bundles(gpu, 3)) == 1
    assert trials_that_fit({"CPU": 0.5}, trial_bundles(auto, 1)) == 1  # Ray then says what is missing

def test_assignment_covers_each_client_once_and_balances():
    sizes = np.array([100, 1, 1, 1, 50, 50, 2, 2])
    parts = assign_clients(range(8), sizes, 3)
    assert sorted(c for p in parts for c in p) == list(range(8))
    loads = sorted(sizes[p].sum() for p in parts)
    assert loads[-1] == 100 and loads[0] >= 50 - 4


@pytest.mark.parametrize("evaluators", [1, 2, 3, 5])
def test_evaluation_shared_by_any_number_of_workers_is_the_same_to_the_bit(evaluators):
    model = build_model(ModelConfig(name="cnn"), (1, 28, 28), 10, seed=0)
    g = np.random.default_rng(0)
    x, y = g.random((1234, 1, 28, 28), dtype=np.float32), g.integers(0, 10, 1234)
    shards = eval_shards(len(y))
    assert shards[0] == (0, 500) and shards[-1] == (1000, 1234)
    parts = [shard_sums(model, x, y, part) for part in deal(shards, evaluators)]
    assert len(parts) == min(evaluators, len(shards))
    assert combine_shards(undeal(parts), len(y)) == evaluate(model, x, y)
    acc, loss = evaluate(model, x, y)
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
    # one 1,234-row forward may round differently from 500-row ones: a near-tie could flip
    assert acc == pytest.approx((logits.argmax(1).numpy() == y).mean(), abs=2 / len(y))
    assert loss == pytest.approx(torch.nn.functional.cross_entropy(logits, torch.from_numpy(y)).item(), rel=1e-5)


@pytest.mark.parametrize("name", ["cnn", "mlp", "logistic"])
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32), (1, 16, 16), (1, 15, 28), (1, 8, 8), (64,), (6,)])
def test_the_torch_free_input_check_refuses_exactly_what_build_model_refuses(name, shape):
    """`dpfl run` checks the model against the data before Ray starts, without torch, and builds
    the model while Ray starts: the check must refuse what building would, and nothing else."""
    cfg = ModelConfig(name=name)
    try:
        model = build_model(cfg, shape, 10, seed=0)
    except DPFLError as err:
        with pytest.raises(DPFLError) as checked:
            check_model_input(cfg, shape)
        assert str(checked.value) == str(err) and "model.name" in str(err)
    else:
        check_model_input(cfg, shape)
        assert np.array_equal(initial_theta(cfg, shape, 10, 0), get_flat(model))


def test_evaluation_runs_the_cnns_pools_channels_last_with_the_same_logits():
    """shard_sums drives a twin whose max-pools run channels-last (half the CPU time of the CNN's
    test-set pass): the same maxima, so the same figures as the model's own forward, and the twin
    follows the model's parameters as they change."""
    from dpfl_ray.training.models import pool_twin

    model = build_model(ModelConfig(name="cnn"), (1, 28, 28), 10, seed=1)
    assert pool_twin(model) is not model and pool_twin(model) is pool_twin(model)
    g = np.random.default_rng(2)
    x, y = g.random((300, 1, 28, 28), dtype=np.float32), g.integers(0, 10, 300)
    for step in range(2):
        with torch.no_grad():
            logits = model(torch.from_numpy(x))
        own = [(int((logits.argmax(1).numpy() == y).sum()),
                float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(y), reduction="sum").item()))]
        assert shard_sums(model, x, y, [(0, 300)]) == own
        set_flat(model, get_flat(model) + np.float32(0.05) * g.standard_normal(get_flat(model).size, dtype=np.float32))
    mlp = build_model(ModelConfig(name="mlp"), (1, 28, 28), 10, seed=1)
    assert pool_twin(mlp) is mlp  # nothing to change: no copy


def test_without_gradients_the_twin_pools_by_shifted_maxima_to_the_bit_ties_and_nan_included():
    """Where no gradient is taken (evaluation, DPAGD's arg-max) the twin's 2x2 pools are the maximum
    of four shifted views: the model's own logits to the bit, on inputs full of ties (whole
    windows of one value) and with a NaN; with gradients on, the pool's own kernel runs."""
    from dpfl_ray.training import models
    from dpfl_ray.training.models import pool_twin

    model = build_model(ModelConfig(name="cnn"), (1, 28, 28), 10, seed=3)
    g = np.random.default_rng(4)
    x = torch.from_numpy(np.round(g.random((64, 1, 28, 28), dtype=np.float32) * 3) / 3)  # 4 levels: ties
    x[5, 0, 10:14, 10:14] = 0.5
    x[7, 0, 3, 3] = float("nan")
    twin = pool_twin(model)
    calls = []
    shifted = models._max_of_four_shifts
    models._max_of_four_shifts = lambda t: calls.append(t.shape) or shifted(t)
    try:
        with torch.no_grad():
            own, fast = model(x), twin(x)
        assert len(calls) == 2  # both pools took the shifted path
        assert torch.equal(torch.nan_to_num(own, nan=7.0), torch.nan_to_num(fast, nan=7.0))
        assert torch.isnan(fast[7]).all() and not torch.isnan(fast[6]).any()
        calls.clear()
        slow = twin(x)
        assert calls == [] and torch.equal(torch.nan_to_num(slow.detach(), nan=7.0), torch.nan_to_num(own, nan=7.0))
    finally:
        models._max_of_four_shifts = shifted
