"""The srun node-loss tests' excuse for the PyPI mpich wheel's cut PMI lines (tests/slurm/
test_multinode.py, docs/multinode.md "Known"): a wait ends at the cut, and only a launch that
never trained next to a cut line is retried; a failure of ours is not excused."""
import pytest

from tests.slurm.test_multinode import CUT_SEEN, PMI2_FLAKE, _wheel_mpi_failure, unless_cut

START = "[train.sbatch] job 7 restart 0 on node[1-3] (3 tasks, launcher srun)\n"
CUT = f"slurmstepd-node2: error: {PMI2_FLAKE} in client request\n"
TRAINING = "\ntraining: 3 ranks\n"
RELAUNCH = "[train.sbatch] node node3 lost: relaunching on the 2 other node(s)\n"


def _check(tmp_path, log, predicate=lambda: False):
    out = tmp_path / "train-7.out"
    out.write_text(log)
    return unless_cut(out, predicate)()


@pytest.mark.parametrize("log", [START + CUT, START + TRAINING + RELAUNCH + CUT])
def test_a_cut_line_before_a_launchs_training_line_ends_the_wait_as_a_flake(tmp_path, log):
    with pytest.raises(AssertionError, match=CUT_SEEN) as e:
        _check(tmp_path, log)
    assert _wheel_mpi_failure(str(e.value) + log)


def test_a_launch_that_trained_is_waited_for_and_its_failure_is_ours(tmp_path):
    trained = START + CUT + TRAINING + RELAUNCH + "\ntraining: 2 ranks\n"
    assert _check(tmp_path, trained) is False  # no cut excuse once every launch trained
    assert _check(tmp_path, START + TRAINING) is False
    assert _check(tmp_path, START + CUT, predicate=lambda: True) is True
    assert not _wheel_mpi_failure("timed out waiting for step 12\n" + trained)
    assert not _wheel_mpi_failure("AssertionError: (19.2, 'log')\n" + START + CUT)  # an assert of ours
    assert not _wheel_mpi_failure(f"{CUT_SEEN}\n" + START + TRAINING)  # no cut line in the log
