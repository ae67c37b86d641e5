from dpfl_ray.scenario import scenario_from_dict


# Tests about the pool itself (several workers' replies merged, a worker crashing or hanging while
# another serves, SecAgg's masks cancelling across workers) ask for it with resources=TWO_WORKERS;
# the others run one worker: each worker process costs about 1.7 s of CPU to start (torch's import);
# one worker less in those runs took tests/ray from 354 to 300 CPU-s.
TWO_WORKERS = {"workers": 2, "num_cpus_per_worker": 0.5}


def every_client_straggles(seconds: float) -> dict:
    """A scenario's ``faults`` section that delays every client ``seconds`` a round (no deadline):
    a run stopped or killed from outside then sleeps while it waits, instead of training flat out."""
    return {"stragglers": {"fraction": 1.0, "latency": {"distribution": "fixed", "seconds": seconds}}}


def tiny_scenario(**sections):
    """A scenario that trains in seconds: synthetic blobs, logistic model, 20 clients, one worker."""
    raw = {
        "name": "tiny", "seed": 3,
        "data": {"source": "synthetic", "num_clients": 20, "synthetic_examples": 600,
                 "synthetic_features": 8, "synthetic_classes": 3},
        "model": {"name": "logistic"},
        "training": {"rounds": 3, "batch_size": 8, "lr": 0.2},
        "sampling": {"mode": "fixed", "clients_per_round": 10},
        "resources": {"workers": 1, "num_cpus_per_worker": 0.5},
    }
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value) if isinstance(value, dict) else raw.__setitem__(key, value)
    return scenario_from_dict(raw)


def dpfl_in_process(*args, env=None):
    """``dpfl ARGS`` in this process through typer's CliRunner (stdout and stderr apart), for a
    command that answers before Ray would start; the signal handlers `dpfl run` installs are put
    back afterwards."""
    import signal

    from typer.testing import CliRunner

    from cli.main import app
    from dpfl_ray.runtime.shutdown import SIGNALS

    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200", **(env or {})})
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def long_dp_fedavg(name: str, rounds: int, **sections) -> dict:
    """A private run on synthetic blobs that goes on long enough to be stopped, signalled or cut
    off mid-run: DP-FedAvg, 40 clients, Poisson q = 0.25, one half-CPU worker."""
    raw = {
        "name": name, "seed": 2,
        "data": {"source": "synthetic", "num_clients": 40, "synthetic_examples": 800, "synthetic_features": 6},
        "model": {"name": "logistic"},
        "training": {"algorithm": "dp_fedavg", "rounds": rounds, "batch_size": 8, "lr": 0.3},
        "sampling": {"mode": "poisson", "rate": 0.25, "clients_per_round": None},
        "privacy": {"noise_multiplier": 1.0, "clipping": {"norm": 1.0}, "accountant": "rdp"},
        "resources": {"workers": 1, "num_cpus_per_worker": 0.5},
    }
    raw.update(sections)
    return raw
