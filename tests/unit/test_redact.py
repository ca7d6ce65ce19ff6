"""Which environment variables a report keeps, and that secrets among them are blanked out.

The tokens below have the documented shapes of real credentials (GitHub `ghp_` + 36,
Hugging Face `hf_`, AWS `AKIA` + 16, JWT, OpenAI-style `sk-`), made of invented characters.
"""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpdoctor.core.redact import REDACTED, is_relevant, redact_value, relevant_env

GHP = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
HF = "hf_" + "Zq7Xw2Vb9Nm4Lk8Jh3Gf6Ds1Ap5"
AKIA = "AKIA" + "Q2WX7EXAMPLE4K9Z"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
SK = "sk-" + "proj-4fJ9kLm2Qx7Rt5Vw8Yz1Ab3Cd"
UUIDS = ("GPU-6f1e0d64-5e3c-4e3f-9a36-7b2a1d1c0e9f", "GPU-0b8a2c11-93d4-4a7e-8f21-c5d6e7f80912")
MIG = ("MIG-6f1e0d64-5e3c-4e3f-9a36-7b2a1d1c0e9f", "MIG-7a2b3c4d-1e2f-4a5b-8c9d-0e1f2a3b4c5d")
RELEVANT = ("NCCL_DEBUG", "NCCL_NET_PLUGIN", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_DISTRIBUTED_DEBUG",
            "GLOO_SOCKET_IFNAME", "CUDA_LAUNCH_BLOCKING", "OMP_PROC_BIND", "UCX_TLS",
            "FI_PROVIDER", "NVIDIA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "MKL_NUM_THREADS")


# -- which names are kept ----------------------------------------------------------------------

@pytest.mark.parametrize("name", RELEVANT + ("OMP_NUM_THREADS", "NCCL_ALGO", "CUDA_VISIBLE_DEVICES"))
def test_training_settings_are_relevant(name):
    assert is_relevant(name)


@pytest.mark.parametrize("name", ["HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "PATH", "HOME", "USER",
                                  "SLURM_JOB_ID", "MASTER_ADDR", "NCCL", "nccl_algo", "PYTHONPATH", "XNCCL_ALGO"])
def test_other_variables_are_not(name):
    assert not is_relevant(name)


def test_relevant_env_keeps_only_relevant_names_sorted():
    environ = {"PATH": "/usr/bin", "NCCL_DEBUG": "INFO", "HF_TOKEN": HF, "CUDA_VISIBLE_DEVICES": "0,1",
               "OMP_NUM_THREADS": "8", "AWS_SECRET_ACCESS_KEY": "x" * 40}
    assert relevant_env(environ) == {"CUDA_VISIBLE_DEVICES": "0,1", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "8"}
    assert list(relevant_env(environ)) == ["CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "OMP_NUM_THREADS"]


def test_relevant_env_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("NCCL_IB_PASSWORD", "hunter2")
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    monkeypatch.setenv("HF_TOKEN", HF)
    env = relevant_env()
    assert env["NCCL_IB_PASSWORD"] == REDACTED and env["NCCL_ALGO"] == "Tree" and "HF_TOKEN" not in env


# -- secrets by name ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["NCCL_IB_PASSWORD", "CUDA_SECRET_KEY", "UCX_AUTH", "NCCL_PLUGIN_TOKEN",
                                  "FI_API_KEY", "NCCL_ACCESSKEY", "OMP_PRIVATE_THING", "NCCL_COOKIE",
                                  "TORCH_DISTRIBUTED_SESSION", "NCCL_CREDENTIALS_FILE", "nccl_ib_passwd",
                                  "NCCL_IB_KEY", "UCX_SSH_KEY", "CUDA_KEY", "NCCL_KEYFILE", "KEY_PATH"])
def test_secret_looking_names_are_redacted_whatever_the_value(name):
    assert redact_value(name, "abc") == REDACTED
    assert redact_value(name, "") == REDACTED


@pytest.mark.parametrize("name", ["NCCL_IB_PKEY", "NCCL_MONKEY_PATCH", "CUDA_HOTKEYS"])
def test_key_inside_a_word_is_not_a_secret(name):
    # The InfiniBand partition key is compared across ranks: a mismatch is a real finding.
    assert redact_value(name, "0x8001") == "0x8001"


# -- secrets by shape, under innocent names ------------------------------------------------------

@pytest.mark.parametrize("token", [GHP, HF, AKIA, JWT, SK, "xoxb-" + "1234567890-abcdefghij",
                                   "gho_" + "Q" * 36, "ghs_" + "7" * 30])
@pytest.mark.parametrize("template", ["{}", "--token {}", "{} --verbose", "url=https://x.example.com/?t={}"])
def test_token_shapes_are_redacted_under_innocent_names(token, template):
    for name in ("NCCL_NET_PLUGIN_ARGS", "CUDA_CACHE_PATH", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        assert redact_value(name, template.format(token)) == REDACTED


def test_a_long_opaque_string_is_redacted():
    assert redact_value("NCCL_COMM_BLOB", "a8f3K2m9Q7x1Z4v6B0n5L3p8R2t7Y1w4") == REDACTED


# -- URL credentials ----------------------------------------------------------------------------

@pytest.mark.parametrize("value, kept", [
    ("https://user:pass@host/x", f"https://user:{REDACTED}@host/x"),
    ("https://alice:s3cret@traces.example.com:8443/upload?x=1",
     f"https://alice:{REDACTED}@traces.example.com:8443/upload?x=1"),
    ("redis://:hunter2@cache.internal:6379/0", f"redis://:{REDACTED}@cache.internal:6379/0"),
    ("a=HTTP://u:p1@h1/ b=ftp://v:p2@h2/", f"a=HTTP://u:{REDACTED}@h1/ b=ftp://v:{REDACTED}@h2/"),
    ("https://host.example.com/path", "https://host.example.com/path"),
])
def test_url_passwords_are_replaced_and_user_and_host_kept(value, kept):
    assert redact_value("NCCL_X", value) == kept


def test_a_password_with_an_unencoded_at_sign_is_redacted_whole():
    value = "https://alice:p@ss-word@traces.example.com/up"  # urllib reads password 'p@ss-word', host 'traces...'
    assert redact_value("TORCH_NCCL_TRACE_URL", value) == f"https://alice:{REDACTED}@traces.example.com/up"


# -- values that must stay -----------------------------------------------------------------------

@pytest.mark.parametrize("name, value", [
    ("NCCL_ALGO", "Ring"),
    ("OMP_NUM_THREADS", "8"),
    ("NCCL_SOCKET_IFNAME", "^lo,docker0"),
    ("NCCL_DEBUG_FILE", "/tmp/nccl.%h.%p.log"),
    ("NCCL_IB_HCA", "mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1"),
    ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:512"),
    ("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7"),
    ("NCCL_TOPO_FILE", "/opt/microsoft/ndv5-topo.xml"),
    ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
    ("CUDA_VISIBLE_DEVICES", UUIDS[0]),
    ("CUDA_VISIBLE_DEVICES", ",".join(UUIDS)),
    ("CUDA_VISIBLE_DEVICES", MIG[0]),
    ("NVIDIA_VISIBLE_DEVICES", ",".join(MIG)),
    ("CUDA_VISIBLE_DEVICES", "GPU-6f1e0d64"),  # a unique UUID prefix, as CUDA accepts
])
def test_ordinary_values_are_kept(name, value):
    assert redact_value(name, value) == value


def test_the_older_mig_device_name_is_kept():
    value = "MIG-GPU-6f1e0d64-5e3c-4e3f-9a36-7b2a1d1c0e9f/1/0"
    assert redact_value("CUDA_VISIBLE_DEVICES", value) == value


# -- properties ----------------------------------------------------------------------------------

ALNUM = string.ascii_letters + string.digits


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(RELEVANT), st.text(max_size=20), st.text(alphabet=ALNUM, min_size=36, max_size=36),
       st.text(max_size=20))
def test_a_github_token_is_never_returned_verbatim(name, before, secret, after):
    token = "ghp_" + secret
    result = redact_value(name, before + token + after)
    assert token not in result and result != before + token + after


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=10),
       st.text(alphabet=string.ascii_lowercase + string.digits + "!$%^&*()=+~", min_size=4, max_size=24),
       st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=12))
def test_a_url_password_never_survives(user, password, host):
    # "Q" is never part of the lowercase user or host; without "-", "_" or "." no token shape can appear.
    secret = "Q9" + password
    result = redact_value("NCCL_X", f"https://{user}:{secret}@{host}.example.com/x")
    assert secret not in result
    assert result == f"https://{user}:{REDACTED}@{host}.example.com/x"


@pytest.mark.parametrize("line, kept", [
    ('    api_key = "abc123secret"', "api_key = "),
    ("password: hunter2", "password: "),
    ('{"password": "hunter2", "rank": 1}', '"rank": 1'),
    ("Authorization: Bearer abcdefghijklmnop", "Authorization: "),
    ("curl -H 'Authorization: Basic dXNlcjpwYXNzd29yZA=='", "curl -H"),
])
def test_secrets_in_source_lines_headers_and_json_text_are_blanked(line, kept):
    from ddpdoctor.core.redact import redact_text

    out = redact_text(line)
    assert kept in out and "<redacted>" in out
    assert not any(s in out for s in ("abc123secret", "hunter2", "abcdefghijklmnop", "dXNlcjpwYXNzd29yZA"))


def test_ordinary_messages_with_colons_are_kept():
    from ddpdoctor.core.redact import redact_text

    line = "rank 1 (vm) failed in stage train: RuntimeError: Connection closed by peer [127.0.0.1]:8107"
    assert redact_text(line) == line


def test_a_url_user_with_a_secret_name_keeps_the_rest_of_the_url():
    """Found by the property above (a user named "key"): the URL's password blanked, then "key:" read as an
    assignment whose value ran to the end of the URL, host and path lost."""
    for user in ("key", "token", "password"):
        assert redact_value("NCCL_X", f"https://{user}:Q90000@a.example.com/x") == \
            f"https://{user}:{REDACTED}@a.example.com/x"
