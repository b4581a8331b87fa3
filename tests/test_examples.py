"""The recipes in examples/, run as far as this machine allows.

``examples/train.py``, ``examples/resumable.py`` and ``examples/smoke.py`` run under ``mpirun`` in chapter
08_multi_host, which checks their losses and output on several layouts, with a hostfile, killed and preempted: here, only what the chapter does
not run (``smoke.py``'s errors, what the scripts import). ``examples/recipe.py`` runs in one
process and under ``mpirun``. Every script's ``join_processes`` is the same, and joins only
under a launcher that started several processes. The Kubernetes JobSet cannot run here: it is parsed, and what it
provides is checked against what the installed JAX's Kubernetes detection reads. (The SLURM batch
script runs for real in tests/test_slurm.py.)
"""

import ast
import inspect
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BIN = os.path.dirname(sys.executable)
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def run(command, devices, timeout=180, **variables):
    """``command`` from the repository root, with ``devices`` simulated CPU devices per process
    and environment ``variables``."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "JAX_"))
    }
    env.update(ROOT_OK, JAX_NUM_CPU_DEVICES=str(devices), PATH=f"{BIN}:{env['PATH']}")
    env.update(variables)
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def test_the_cluster_hostfile_lists_slots_per_host():
    lines = [
        line.split()
        for line in (EXAMPLES / "mpi/hosts").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines == [["node0", "slots=8"], ["node1", "slots=8"]]


def test_train_py_uses_only_jax_for_the_multi_process_parts():
    source = (EXAMPLES / "train.py").read_text()
    imports = set(re.findall(r"^(?:from|import) ([\w.]+)", source, re.M))
    assert imports == {"os", "jax", "jax.numpy", "numpy", "jax.sharding"}
    assert "jax.distributed.initialize(" in source
    assert "jax.make_array_from_process_local_data(" in source


# --- Kubernetes: the JobSet against JAX's own detection --------------------------------------


@pytest.fixture(scope="module")
def manifest():
    docs = list(yaml.safe_load_all((EXAMPLES / "k8s/jobset.yaml").read_text()))
    return {doc["kind"]: doc for doc in docs}


@pytest.fixture(scope="module")
def jax_k8s_source():
    # JAX's Kubernetes detection, as installed
    from jax._src.clusters import (
        k8s_cluster,
    )

    return inspect.getsource(k8s_cluster)


def test_the_jobset_is_one_indexed_job_with_a_process_per_pod(manifest, jax_k8s_source):
    jobset = manifest["JobSet"]
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    [replicated] = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    # JAX: process count = the Job's parallelism, process id = JOB_COMPLETION_INDEX.
    assert "return cls._job().spec.parallelism" in jax_k8s_source
    assert "os.environ['JOB_COMPLETION_INDEX']" in jax_k8s_source
    assert replicated["replicas"] == 1 and job["parallelism"] == job["completions"] == 2
    assert job["completionMode"] == "Indexed"
    [container] = job["template"]["spec"]["containers"]
    assert container["command"] == ["python", "examples/train.py"]


def test_the_jobset_names_the_coordinator_jax_computes(manifest, jax_k8s_source):
    # JAX's coordinator: pod 0 of the Job, under the JobSet's name as DNS subdomain, port 55527.
    assert "'jobset.sigs.k8s.io/jobset-name' in job.metadata.labels" in jax_k8s_source
    assert "'{job_name}-0.{subdomain}'" in jax_k8s_source
    assert "_coordinator_port = '55527'" in jax_k8s_source
    jobset = manifest["JobSet"]
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    [container] = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"][
        "spec"
    ]["containers"]
    assert container["ports"] == [{"containerPort": 55527}]


def test_the_service_account_may_read_what_jax_asks_for(manifest, jax_k8s_source):
    # The API calls JAX makes for a JobSet's pod, and the permission each one needs.
    needs = {
        "list_namespaced_pod": ("", "pods", "list"),
        "read_namespaced_job": ("batch", "jobs", "get"),
    }
    for call in needs:
        assert f"{call}(" in jax_k8s_source
    pod = manifest["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"
    ]
    account = pod["spec"]["serviceAccountName"]
    assert manifest["ServiceAccount"]["metadata"]["name"] == account
    binding = manifest["RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    role = manifest["Role"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert set(needs.values()) <= granted


def test_jax_needs_the_kubernetes_package_and_the_in_cluster_variables(jax_k8s_source):
    # What a pod provides on its own: the API server's address, its hostname, the namespace file.
    for needed in (
        "'KUBERNETES_SERVICE_HOST' in os.environ",
        "os.getenv('HOSTNAME')",
        "/var/run/secrets/kubernetes.io/serviceaccount/namespace",
        "import kubernetes as k8s",
        "pip install jax[k8s]",
    ):
        assert needed in jax_k8s_source, needed
    assert "jax[cuda12,k8s]" in (EXAMPLES / "k8s/jobset.yaml").read_text()


def test_mpirun_is_on_the_environments_path():
    assert shutil.which("mpirun", path=BIN)


# examples/recipe.py: the script to copy (issue: the reader's path). It must stand alone.


def recipe_losses(stdout):
    return [float(v) for v in re.findall(r"^step +\d+  loss ([\d.]+)$", stdout, re.M)]


@pytest.fixture(scope="module")
def recipe_one_process(tmp_path_factory):
    checkpoints = tmp_path_factory.mktemp("recipe")
    out = run(
        ["python", "examples/recipe.py"], 8, STEPS="40", CHECKPOINT_DIR=str(checkpoints)
    )
    return out, checkpoints


def test_recipe_imports_nothing_from_the_package():
    source = (EXAMPLES / "recipe.py").read_text()
    assert "jaxdist_lessons" not in source
    imported = set(re.findall(r"^(?:from|import) (\w+)", source, re.M))
    assert imported <= {"os", "re", "flax", "jax", "numpy", "optax", "orbax", "sklearn"}


def test_recipe_learns_and_saves_a_checkpoint(recipe_one_process):
    out, checkpoints = recipe_one_process
    values = recipe_losses(out)
    assert len(values) == 40 and values[-1] < 0.6 * values[0]  # 2.27 to 1.19 here
    assert "saved step 40 to" in out and "{'data': 4, 'tensor': 2} mesh" in out
    assert (checkpoints / "40").is_dir()


def test_recipe_runs_unchanged_under_mpirun_with_the_same_losses(
    recipe_one_process, tmp_path
):
    out = run(
        [
            "mpirun",
            "--map-by",
            ":OVERSUBSCRIBE",
            "-np",
            "2",
            "python",
            "examples/recipe.py",
        ],
        4,
        timeout=300,  # a hang fails here, not in CI's limit
        STEPS="10",
        CHECKPOINT_DIR=str(tmp_path),
    )
    assert "{'data': 4, 'tensor': 2} mesh" in out and (tmp_path / "10").is_dir()
    # The same global batches on 2 processes x 4 devices as on 1 process x 8 devices (the
    # learning rate is constant: the first 10 steps of a 40-step run are a 10-step run).
    assert recipe_losses(out) == pytest.approx(
        recipe_losses(recipe_one_process[0])[:10], rel=1e-4
    )


# --- join_processes: every example joins only when a launcher started several ------------------

SCRIPTS = [  # from the repository's root
    "examples/bandwidth.py",
    "examples/smoke.py",
    "examples/train.py",
    "examples/resumable.py",
    "examples/recipe.py",
    "jaxdist_lm/train.py",
]
# JAX's Open MPI 4 detection (OmpiCluster) takes this variable alone, and raises on its missing
# address: a script that called jax.distributed.initialize() here would fail at once.
NEVER_JOINS = {"OMPI_MCA_orte_hnp_uri": "1.0;no-address"}
# launcher -> its variables, and the detection method the script should pass (None: JAX's own);
# NO_JOIN where the process must stay alone.
NO_JOIN = "no join"
LAUNCHERS = {
    "no launcher": ({}, NO_JOIN),
    "mpirun -np 2": ({"OMPI_COMM_WORLD_SIZE": "2"}, "mpi4py"),
    "mpirun -np 1": ({"OMPI_COMM_WORLD_SIZE": "1"}, NO_JOIN),
    "srun -n 2": ({"SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "node0"}, None),
    "srun -n 1": ({"SLURM_NTASKS": "1", "SLURM_STEP_NODELIST": "node0"}, NO_JOIN),
    "salloc -n 2, no srun": ({"SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}, NO_JOIN),
    "a JobSet's pod": (
        {"JOB_COMPLETION_INDEX": "1", "KUBERNETES_SERVICE_HOST": "10.0.0.1"},
        None,
    ),
    "a lone Kubernetes pod": ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, NO_JOIN),
    "GKE, a 4-host TPU slice": ({"TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3"}, None),
    "GKE, a 1-host TPU slice": ({"TPU_WORKER_HOSTNAMES": "h0"}, NO_JOIN),
    "two 1-host TPU slices": (
        {"TPU_WORKER_HOSTNAMES": "h0", "MEGASCALE_NUM_SLICES": "2"},
        None,
    ),
    "a Cloud TPU VM slice": ({"JAX_COORDINATOR_ADDRESS": "10.0.0.2:8482"}, None),
    "Open MPI 4's variable alone": (NEVER_JOINS, NO_JOIN),
}
VARIABLES = {name for variables, _ in LAUNCHERS.values() for name in variables}


def join_processes_of(script: str) -> tuple:
    """``script``'s join_processes, its source, and the calls it makes to a stand-in for
    jax.distributed.initialize."""
    path = ROOT / script
    source = path.read_text()
    [node] = [
        n
        for n in ast.parse(source).body
        if isinstance(n, ast.FunctionDef) and n.name == "join_processes"
    ]
    calls = []
    distributed = types.SimpleNamespace(initialize=lambda **kw: calls.append(kw))
    namespace = {"os": os, "jax": types.SimpleNamespace(distributed=distributed)}
    exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    return namespace["join_processes"], ast.get_source_segment(source, node), calls


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_each_example_joins_only_when_a_launcher_started_several(
    script, launcher, monkeypatch
):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    variables, method = LAUNCHERS[launcher]
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    join_processes, _, calls = join_processes_of(script)
    if method == NO_JOIN:
        assert join_processes() is False and calls == []
    else:
        assert join_processes() is True
        assert calls == [{"cluster_detection_method": method}]


def test_the_examples_share_one_join_rule_and_call_initialize_nowhere_else():
    """The same function, word for word, in every script; no other call of initialize in
    examples/ or the LM recipe (jaxdist_lm/); and every variable it reads is one the
    installed JAX's detection reads."""
    first = join_processes_of(SCRIPTS[0])[1]
    for script in SCRIPTS[1:]:
        assert join_processes_of(script)[1] == first, script
    for path in [*EXAMPLES.rglob("*.py"), *(ROOT / "jaxdist_lm").glob("*.py")]:
        tree = ast.parse(path.read_text())
        inside = {
            id(n)
            for f in tree.body
            if isinstance(f, ast.FunctionDef) and f.name == "join_processes"
            for n in ast.walk(f)
        }
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and ast.unparse(n).endswith(
                "distributed.initialize"
            ):
                assert id(n) in inside, f"{path}:{n.lineno}"
    from jax._src import clusters, distributed

    read = inspect.getsource(distributed) + "".join(
        p.read_text() for p in pathlib.Path(clusters.__file__).parent.glob("*.py")
    )
    names = {
        n.value
        for n in ast.walk(ast.parse(first))
        if isinstance(n, ast.Constant) and str(n.value).isupper()
    }
    assert len(names) == 8
    for name in names:
        assert f"'{name}'" in read, name


# --- examples/smoke.py: the first thing to run on a new cluster ---------------------------------


def test_smoke_exits_1_saying_what_is_wrong():
    """No launcher: one process, and it says why. It never calls initialize(): JAX's Open
    MPI 4 detection would take this address-less variable and raise (NEVER_JOINS)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAXDIST_", "JAX_", "OMPI_", "SLURM_", "PMI"))
    }
    result = subprocess.run(
        [sys.executable, "examples/smoke.py", "--expect-devices", "3"],
        cwd=ROOT,
        env={**env, "JAX_NUM_CPU_DEVICES": "2", **NEVER_JOINS},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stdout.startswith(
        "running as one process: no launcher (mpirun, srun, Kubernetes, a TPU slice) "
        "started several\n"
    )
    assert result.stderr.strip().endswith(
        "smoke test FAILED on process 0: the job has 2 devices, not 3: check the tasks per node, "
        "the GPUs each task sees (CUDA_VISIBLE_DEVICES) and local_device_ids"
    )


def test_smoke_imports_nothing_from_the_package():
    assert "jaxdist_lessons" not in (EXAMPLES / "smoke.py").read_text()


def test_the_container_job_checks_each_node_before_it_trains():
    """examples/slurm/container.sbatch: valid bash, the gpu.sbatch shape, pyxis's
    --container-image, the preflight on one task a node, then the bandwidth floor."""
    script = EXAMPLES / "slurm" / "container.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    for line in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8"):
        assert f"#SBATCH {line}\n" in text
    assert (
        "source examples/slurm/gpu_env.sh" in text
        and '--container-image="$IMAGE"' in text
    )
    order = [
        text.index(s)
        for s in (
            "preflight.py --expect-gpus 8",
            "bandwidth.py --collective all-reduce",
            "smoke.py --expect-devices",
        )
    ]
    assert (
        order == sorted(order)
        and "--ntasks-per-node=1 python examples/preflight" in text
    )


def test_the_tuning_settings_are_opt_in_and_this_xla_knows_each_flag():
    """JAXDIST_TUNE=1 adds PGLE and the combine and pipelining flags; an XLA that did not
    know a flag would abort at start-up (XLA:CPU reads the GPU flags too)."""
    program = (
        "source examples/slurm/gpu_env.sh; echo $XLA_FLAGS; python -c "
        "'import jax; jax.numpy.ones(1).block_until_ready(); "
        "print(jax.config.jax_enable_pgle, jax.config.jax_pgle_profiling_runs)'"
    )
    base = {"PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    words = {}
    for tune in ("0", "1"):
        result = subprocess.run(
            ["bash", "-c", program],
            cwd=ROOT,
            env={**base, "JAXDIST_TUNE": tune},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        words[tune] = result.stdout.split()
    assert words["0"] == [
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "False",
        "3",
    ]
    assert words["1"][-2:] == ["True", "3"]
    assert words["1"][1:-2] == [
        "--xla_gpu_all_gather_combine_threshold_bytes=1073741824",
        "--xla_gpu_all_reduce_combine_threshold_bytes=1073741824",
        "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
        "--xla_gpu_enable_pipelined_all_gather=true",
        "--xla_gpu_enable_pipelined_reduce_scatter=true",
        "--xla_gpu_enable_pipelined_all_reduce=true",
    ]
