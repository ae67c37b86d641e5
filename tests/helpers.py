from dpfl_ray.scenario import scenario_from_dict


def tiny_scenario(**sections):
    """A scenario that trains in seconds: synthetic blobs, logistic model, 20 clients."""
    raw = {
        "name": "tiny", "seed": 3,
        "data": {"source": "synthetic", "num_clients": 20, "synthetic_examples": 600,
                 "synthetic_features": 8, "synthetic_classes": 3},
        "model": {"name": "logistic"},
        "training": {"rounds": 3, "batch_size": 8, "lr": 0.2},
        "sampling": {"mode": "fixed", "clients_per_round": 10},
        "resources": {"workers": 2, "num_cpus_per_worker": 0.5},
    }
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value) if isinstance(value, dict) else raw.__setitem__(key, value)
    return scenario_from_dict(raw)
