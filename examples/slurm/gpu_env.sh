# What a JAX job on a GPU cluster sets, sourced by gpu.sbatch and lm.sbatch (a value you
# export before sbatch wins). Your cluster's names: `ip -brief address` lists the IP
# interfaces, `ibv_devices` the InfiniBand adapters; ask its admins which network is
# the fast one.

# NCCL, https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html
# NCCL_SOCKET_IFNAME: the IP interfaces NCCL may use (a list of prefixes; ^ excludes).
# Name the cluster's data network (e.g. =ib0 or =eth1) where a management port would
# otherwise be picked.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}
# NCCL_IB_HCA: the InfiniBand/RoCE adapters NCCL uses across nodes (mlx5 = all mlx5_*).
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}
# NCCL_DEBUG=WARN: NCCL prints why it failed; INFO also prints the transports it chose
# (NET/IB or NET/Socket) at start-up, the first thing to check on a slow multi-node job.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# JAX preallocates 75% of each GPU's memory by default; 90% leaves room for NCCL and
# cuDNN. https://docs.jax.dev/en/latest/gpu_memory_allocation.html
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}

# The latency-hiding scheduler overlaps collectives with computation (an FSDP all-gather
# with the previous layer's matmuls).
# https://docs.jax.dev/en/latest/gpu_performance_tips.html
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"

# Once the job runs, export JAXDIST_TUNE=1 before sbatch for the settings a team adds
# next (the book's "Running on GPU clusters" page; none measured by the book yet).
if [ "${JAXDIST_TUNE:-0}" = 1 ]; then
    # Profile-guided latency estimation: JAX profiles the step's first runs, then
    # compiles it again with the measured costs for the latency-hiding scheduler.
    # https://docs.jax.dev/en/latest/gpu_performance_tips.html
    export JAX_ENABLE_PGLE=${JAX_ENABLE_PGLE:-true}
    export JAX_PGLE_PROFILING_RUNS=${JAX_PGLE_PROFILING_RUNS:-3}
    # Merge small collectives into large ones and pipeline them over the layers' loop:
    # JAX-Toolbox's MaxText values (1 GiB gathers and all-reduces, 128 MiB scatters).
    # https://github.com/NVIDIA/JAX-Toolbox/blob/main/docs/frameworks/maxtext/README.md
    export XLA_FLAGS="$XLA_FLAGS --xla_gpu_all_gather_combine_threshold_bytes=1073741824
        --xla_gpu_all_reduce_combine_threshold_bytes=1073741824
        --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728
        --xla_gpu_enable_pipelined_all_gather=true
        --xla_gpu_enable_pipelined_reduce_scatter=true
        --xla_gpu_enable_pipelined_all_reduce=true"
fi
