import subprocess
import sys

import kvxfer


def test_errors_share_one_base():
    for name in ["TransferTimeout", "PeerDisconnected", "LayoutMismatch", "AuthenticationError",
                 "RegistrationError", "InvalidDescriptor", "TransferCancelled", "ProtocolError"]:
        assert issubclass(getattr(kvxfer, name), kvxfer.KVXferError)


def test_import_is_lazy():
    code = "import sys, kvxfer; print('torch' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_unknown_attribute():
    import pytest

    with pytest.raises(AttributeError):
        kvxfer.does_not_exist
