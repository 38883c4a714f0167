import ray

from components.cluster import init_ray, local_init_kwargs
from components.config import RayConfig


def test_ray_runs_tasks_and_init_is_idempotent(ray_session):
    assert ray_session["CPU"] >= 1

    @ray.remote(num_cpus=0.25)
    def square(x: int) -> int:
        return x * x

    assert ray.get([square.remote(i) for i in range(4)]) == [0, 1, 4, 9]
    assert init_ray(RayConfig()) == ray.cluster_resources()  # already up: joins, no restart


def test_local_settings_for_small_machines():
    kwargs = local_init_kwargs(RayConfig(num_cpus=3, object_store_memory_mb=128))
    assert kwargs["num_cpus"] == 3 and kwargs["object_store_memory"] == 128 * 1024 * 1024
    assert kwargs["include_dashboard"] is True and kwargs["dashboard_host"] == "127.0.0.1"  # loopback only
    assert "dashboard_host" not in local_init_kwargs(RayConfig(include_dashboard=False))


def test_the_dashboard_answers_on_loopback(ray_session):
    import json
    import urllib.request

    from components.cluster import dashboard_url

    url = dashboard_url()
    assert url is not None and url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(f"{url}/api/version", timeout=30) as resp:
        assert json.loads(resp.read())["ray_version"] == ray.__version__
