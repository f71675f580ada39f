"""The default job family (`ettr.family.derive_family`): the script or module, looked for through launchers."""

from __future__ import annotations

import random

import pytest

from ettr.family import UNKNOWN_FAMILY, derive_family


@pytest.mark.parametrize(
    ("command", "family"),
    [
        (["python", "train.py", "--lr", "3"], "train"),
        (["/usr/bin/python3", "-u", "jobs/pretrain.py"], "pretrain"),
        (["python", "-m", "mypkg.train", "--x"], "mypkg.train"),
        (["torchrun", "--nproc-per-node", "8", "--standalone", "scripts/ft.py", "-c", "a.yaml"], "ft"),
        (["torchrun", "--nnodes=2", "--rdzv-endpoint", "h:1", "-m", "mypkg.train"], "mypkg.train"),
        (["torchrun", "--nproc-per-node", "8", "examples/run_clm.py", "--model", "gpt2"], "run_clm"),
        (["python", "-m", "torch.distributed.run", "--nproc_per_node=2", "x/t.py"], "t"),
        (["python", "-mtorch.distributed.run", "--nproc_per_node=2", "x/t.py"], "t"),
        (["./launch.sh", "1"], "launch.sh"),
        (["bash", "launch.sh", "1"], "launch.sh"),  # a shell is looked through, as a launcher is
        (["/bin/bash", "-e", "-o", "pipefail", "scripts/launch.sh"], "launch.sh"),
        (["bash", "-c", "torchrun --nproc-per-node 2 train.py --lr 3"], "train"),
        (["sh", "-ec", "python -m pkg.train"], "pkg.train"),
        (["bash", "-c", "echo 'unbalanced"], "bash"),
        (["bash"], "bash"),
        (["env", "OUT=out-7", "bash", "job.sh"], "job.sh"),  # nanoGPT's wrapper, as it ran in a fleet
        (["env", "-i", "-u", "HOME", "A=1", "python", "train.py"], "train"),
        (["env", "A=1"], "env"),
        (["python", "-c", "print(1)"], "python"),
        ([], UNKNOWN_FAMILY),
    ],
)
def test_family_is_derived_from_the_command_not_its_arguments(command, family):
    assert derive_family(command) == family


@pytest.mark.parametrize(
    ("command", "family"),
    [
        # accelerate launch: options with values, flags, `=` forms, `-m`, the module and binary forms.
        (
            "accelerate launch --num_processes 2 --config_file f.yaml --mixed_precision no --multi_gpu --cpu"
            " --use_deepspeed nlp/complete_nlp_example.py --lr 3",
            "complete_nlp_example",
        ),
        ("accelerate launch --num-processes=2 --same_network --gpu_ids 0,1 cv_example.py", "cv_example"),
        ("accelerate launch -m mypkg.train --x 1", "mypkg.train"),
        ("accelerate launch --dynamo_use_fullgraph --main_process_port 29500 -q train.py", "train"),
        ("accelerate-launch --cpu t.py", "t"),
        ("python -m accelerate.commands.launch --num_processes 2 t.py", "t"),
        ("python -m accelerate.commands.accelerate_cli launch --num_processes 2 t.py", "t"),
        ("accelerate launch --no_python bash run.sh", "run.sh"),  # the shell is looked through too
        # DeepSpeed's runner, its script forms and its module form.
        (
            "deepspeed --num_gpus 2 --num_nodes 1 --hostfile hosts --include localhost:0,1 --master_port 29500"
            " --no_local_rank --force_multi --autotuning tune train.py --deepspeed_config ds.json",
            "train",
        ),
        ("/usr/bin/python3 /venv/bin/deepspeed --num_gpus 2 train.py", "train"),
        ("ds --num_gpus=2 -H hosts bert.py", "bert"),
        ("deepspeed --module mypkg.train", "mypkg.train"),
        ("python -m deepspeed.launcher.runner --num_gpus 2 train.py", "train"),
        # mpirun / mpiexec (Open MPI, MPICH's hydra): single-dash words, two-value options.
        ("mpirun -np 2 python train.py", "train"),
        ("mpirun --allow-run-as-root --oversubscribe -np 2 -x VAR -H host python train.py --lr 3", "train"),
        (
            "mpiexec -n 2 --map-by ppr:1:node --bind-to none -hostfile h --tag-output -mca btl tcp ./a.out",
            "a.out",
        ),
        ("mpiexec.hydra -genv OMP_NUM_THREADS 1 -ppn 2 python3 -u t.py", "t"),
        # srun: getopt short options (bundled, value attached or not), long ones with and without `=`.
        (
            "srun -N 2 --ntasks-per-node=2 -n 4 --gres gpu:8 --mpi=pmix --exclusive -l python train.py",
            "train",
        ),
        ("srun -lN2 --cpus-per-task 8 torchrun --nproc-per-node 8 ft.py", "ft"),
        ("srun --ntasks 2 accelerate launch --multi_gpu x.py", "x"),
        # An option the tables do not know, followed by the script: the script, not the option's value.
        ("accelerate launch --a_future_flag train.py", "train"),
        ("mpirun --a-future-flag python train.py", "train"),
        # Nothing after the options, or another subcommand: the launcher's own name.
        ("accelerate launch --cpu", "accelerate"),
        ("accelerate config", "accelerate"),
        ("srun", "srun"),
        ("mpirun -np", "mpirun"),
    ],
)
def test_a_launcher_is_looked_through_to_the_command_it_runs(command, family):
    assert derive_family(command.split()) == family


def test_two_accelerate_scripts_are_two_families():
    first = derive_family("accelerate launch --num_processes 2 nlp_example.py".split())
    second = derive_family("accelerate launch --num_processes 2 cv_example.py".split())
    assert first != second


def test_any_command_gets_a_family_and_nothing_raises():
    vocabulary = (
        "accelerate launch accelerate-launch deepspeed ds srun mpirun mpiexec torchrun python python3 -m -c"
        " -u -X -- - = --num_processes --num_processes=2 -np -n -N -lN2 -mca --mca -x -H --module --no_python"
        " --no-python --cpu --multi_gpu --exclusive torch.distributed.run accelerate.commands.launch"
        " deepspeed.launcher.runner accelerate.commands.accelerate_cli train.py /bin/deepspeed 2 host"
        " bash sh env A=1 -u -o -ec ' run.sh"
    ).split() + [""]
    rng = random.Random(0)
    for _ in range(5000):
        command = [rng.choice(vocabulary) for _ in range(rng.randrange(8))]
        family = derive_family(command)
        assert isinstance(family, str) and family, command
