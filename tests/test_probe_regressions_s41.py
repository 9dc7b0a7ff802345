"""Session 41: paths a rename missed (CI caught them in verification, not the suite's
quick subset). Each test runs one line that raised NameError."""

import torch
import torch.nn.functional as F

from rewrite.ops.base import Instances
from rewrite.ops.builders import op
from rewrite.ops.effects import graph_mode


def _traced(fn):
    return torch.fx.symbolic_trace(fn)


def test_graph_mode_reads_a_functional_batch_norm_flag():
    mean, var = torch.zeros(3), torch.ones(3)
    training = _traced(lambda x: F.batch_norm(x, mean, var, training=True))
    evaluating = _traced(lambda x: F.batch_norm(x, mean, var, training=False))
    assert graph_mode(training) is True
    assert graph_mode(evaluating) is False


def test_graph_mode_reads_a_functional_dropout_flag():
    assert graph_mode(_traced(lambda x: F.dropout(x, 0.5))) is True  # training defaults to True
    assert graph_mode(_traced(lambda x: F.dropout(x, 0.5, training=False))) is False


def test_an_op_may_name_its_instance_family():
    opdef = op("s41_neg", "input: T", torch=None, aten=None, instances="unary")
    assert opdef.instances == Instances("unary")


def test_save_refuses_a_folder_where_no_file_can_be_created_before_any_work(tmp_path):
    from rewrite.capture import missing_folder

    assert "cannot create a file in the folder '/proc'" in missing_folder("/proc/out.pt")
    assert missing_folder(tmp_path / "out.pt") is None
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_write_atomically_names_the_path_when_no_file_can_be_created():
    import pytest

    from rewrite.capture import SaveError, write_atomically

    with pytest.raises(SaveError, match="cannot write '/proc/out.pt'"):
        write_atomically("/proc/out.pt", lambda f: None)
