"""The README as a newcomer follows it.

- Its local flow, command by command as written, in a fresh copy of the repository (what a clone
  holds: the tracked files and those git does not ignore; no build output), with the variables
  `trainfleet local up` prints pasted into the environment as the README says.
- Its AWS path: the steps in the order they are done, and every command of them one that exists
  (a make target, a `trainfleet` command and its options, a `sam` command and its options, an AWS
  CLI command of the AWS API) with the files and stack outputs it names. Nothing here reaches AWS.
- Its word on what has never run on a GPU, kept true against docs/BENCHMARKS.md.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import botocore.session
import pytest

from localcloud.waiting import run_captured, sizes, until
from trainfleet.cli import build_parser
from trainfleet.core.runspec import RunSpec
from trainfleet.operator.validate import load_template

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def section(title: str) -> str:
    """The README's text under `## title`, up to the next section."""
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.MULTILINE | re.DOTALL)
    assert found, f"the README has no section {title!r}"
    return found[1]


def code_blocks(text: str) -> list[list[str]]:
    """Each fenced block's command lines, a trailing `# comment` taken off."""
    return [[re.sub(r"\s+# .*$", "", line).strip() for line in block.splitlines() if line.strip()]
            for block in re.findall(r"^```\n(.*?)^```", text, re.MULTILINE | re.DOTALL)]


def fresh_copy(folder: Path) -> Path:
    """The repository's files as a clone of this checkout would hold them."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, folder / name)
    return folder


# --- the local flow -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def local_flow(tmp_path_factory) -> dict:
    """The README's local flow, each command's result by its line. `local up` gets `--port 0`: a
    fixed port may be taken on a shared machine, and the lines it prints carry the one it took."""
    (up,), commands = code_blocks(section("The local flow, by hand"))
    folder = tmp_path_factory.mktemp("readme")
    copy = fresh_copy(folder / "trainfleet")
    (copy / ".venv").symlink_to(REPO / ".venv")  # `make install`'s: the installs are not what is tested here
    # Nothing of this process's environment points anywhere: only what the newcomer pastes.
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith(("AWS_", "TRAINFLEET_")) and name != "MOTO_IAM_LOAD_MANAGED_POLICIES"}
    environment |= {"PYTHONPATH": str(copy), "COLUMNS": "100"}
    printed = folder / "local-up.log"
    with printed.open("w") as log:
        server = subprocess.Popen([*shlex.split(up), "--port", "0"], cwd=copy, stdout=log,
                                  stderr=subprocess.STDOUT, text=True, env=environment)
    results = {}
    try:
        lines = until(lambda: "# instance metadata" in printed.read_text() and printed.read_text().splitlines(),
                      lambda: (server.poll(), sizes([printed])), what="`local up` to print its variables")
        results["local up"] = lines
        for line in lines:
            if line.startswith("export "):
                name, _, value = shlex.split(line.removeprefix("export "))[0].partition("=")
                environment[name] = value
        for command in commands:
            results[command] = run_captured(shlex.split(command), what=command, cwd=copy, env=environment)
            if results[command].returncode != 0:
                break
        results["report files"] = sorted(path.name for path in (copy / "reports" / "local-demo").iterdir())
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
    results["local up"] += printed.read_text().splitlines()[len(results["local up"]):]
    return results


def done(results: dict, command: str) -> str:
    line = ".venv/bin/trainfleet " + command
    result = results[line]
    assert result.returncode == 0, (line, result.stdout[-3000:], result.stderr[-3000:])
    return result.stdout


@pytest.mark.slow
def test_the_local_flow_deploys_the_stack_and_trains_the_run_to_its_end(local_flow):
    assert local_flow["local up"][0].startswith("local cloud running at http://127.0.0.1:")
    deployed = done(local_flow, "local deploy").splitlines()
    assert deployed[0].startswith("deployed stack trainfleet in us-east-1: ") and len(deployed) < 40
    watched = done(local_flow, "run start events/local-demo-run.json --watch")
    assert "execution SUCCEEDED" in watched and "step 60 of 60" in watched, watched[-3000:]
    assert "local-demo" in done(local_flow, "run list")


@pytest.mark.slow
def test_the_local_flows_logs_checkpoints_and_report(local_flow):
    logs = done(local_flow, "run logs local-demo").splitlines()
    assert [line for line in logs if " Launch INFO launch spec written" in line]
    assert not [line for line in logs if " ERROR " in line], "a run that succeeded logs no error"
    node = done(local_flow, "run logs local-demo --node 0").splitlines()
    assert [line for line in node if " agent INFO starting torchrun" in line]
    assert not [line for line in node if "Warning" in line], "no warning a user cannot act on"
    # 60 steps, a checkpoint every 10, keep_last 3: the steps kept, not the three pruned.
    listing = done(local_flow, "checkpoint list local-demo")
    steps = [line.split()[:2] for line in listing.splitlines() if line.split() and line.split()[0].isdigit()]
    assert steps == [["60", "committed"], ["50", "committed"], ["40", "committed"]], listing
    assert "report written: reports/local-demo/report.html" in done(local_flow, "run report local-demo")
    assert {"report.html", "report.json", "report-loss.png"} <= set(local_flow["report files"])
    assert not [line for line in local_flow["local up"] if len(line) > 300], "the local cloud's terminal reads"


# --- the AWS path ---------------------------------------------------------------------------

STEPS = ("Tools on PATH", "The nodes' software", "The stack", "A first run", "Watching it", "Stopping it",
         "Deleting the stack", "A cost ceiling")


def aws_steps() -> list[tuple[str, list[str]]]:
    """Each numbered step of the AWS section: its title and its commands."""
    text = section("Deploying to AWS")
    found = re.findall(r"^\*\*(\d+)\. (.+?)\.\*\*(.*?)(?=^\*\*\d+\. |\Z)", text, re.MULTILINE | re.DOTALL)
    assert [int(number) for number, _, _ in found] == list(range(1, len(found) + 1))
    return [(title, [command for block in code_blocks(body) for line in block for command in line.split(" && ")])
            for _, title, body in found]


def test_the_aws_path_is_told_in_the_order_it_is_done():
    assert tuple(title for title, _ in aws_steps()) == STEPS
    commands = [command for _, step in aws_steps() for command in step]
    order = ["make install", "make artifacts", "sam build", "sam deploy", "make artifacts BUCKET=",
             "trainfleet run start", "trainfleet run status", "trainfleet run stop", "sam delete"]
    places = [next(index for index, command in enumerate(commands) if command.startswith(first)) for first in order]
    assert places == sorted(places), list(zip(order, places))


MAKE_TARGETS = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.MULTILINE))
TEMPLATE_OUTPUTS = set(load_template((REPO / "template.yaml").read_text())["Outputs"])


def test_every_command_of_the_aws_path_exists():
    sam = REPO / ".venv-sam" / "bin" / "sam"
    assert sam.exists(), "the sam commands are checked with the sam that `make sam-tools` installs"
    checked = 0
    for _, commands in aws_steps():
        for command in commands:
            words = shlex.split(command.replace("$(", " ").replace(")", ""))
            if words[0].startswith("BUCKET="):  # BUCKET=$(aws ...)
                words = words[1:]
            if words[0] == "make":
                assert {word for word in words[1:] if "=" not in word} <= MAKE_TARGETS, command
                assert all(word.split("=")[0] in (REPO / "Makefile").read_text() for word in words[1:] if "=" in word)
            elif words[0] == "export":
                assert words[1] == "PATH=$PWD/.venv/bin:$PWD/.venv-sam/bin:$PATH", "the installs' own folders"
            elif words[0] == "cp":
                document = json.loads((REPO / words[1]).read_text())
                RunSpec.model_validate(document)  # the example is a RunSpec as it stands
            elif words[0] == "trainfleet":
                arguments = [word.replace("$BUCKET", "my-bucket") for word in words[1:]]
                build_parser().parse_args(arguments)  # exits (SystemExit) on a command or option that does not exist
                if arguments[0] == "plan":
                    planned = subprocess.run([sys.executable, "-m", "trainfleet.cli", *arguments], cwd=REPO,
                                             capture_output=True, text=True)
                    assert planned.returncode == 0 and "fits:" in planned.stdout, planned.stdout + planned.stderr
            elif words[0] == "sam":
                options = [word for word in words[2:] if word.startswith("--")]
                helped = subprocess.run([str(sam), words[1], "--help"], capture_output=True, text=True,
                                        env=os.environ | {"SAM_CLI_TELEMETRY": "0"})
                assert helped.returncode == 0 and all(option in helped.stdout for option in options), command
            elif words[0] == "aws":
                _aws_command_exists(words[1:])
            else:
                raise AssertionError(f"the README's AWS path has a command this test does not know: {command}")
            checked += 1
    assert checked >= 15


def _aws_command_exists(words: list[str]) -> None:
    """An AWS CLI command is an operation of its service's API (the CLI is made from the same
    models botocore has), its options the operation's parameters or the CLI's own."""
    service, operation, *options = words
    model = botocore.session.get_session().get_service_model(service)
    names = {re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower(): name for name in model.operation_names}
    assert operation in names, f"aws {service} {operation}"
    members = model.operation_model(names[operation]).input_shape
    parameters = {re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower() for name in (members.members if members else {})}
    for option in (word[2:] for word in options if word.startswith("--")):
        assert option in parameters | {"query", "output", "region", "profile"}, f"aws {service} {operation} --{option}"
    for output in re.findall(r"OutputKey=='(\w+)'", " ".join(options)):
        assert output in TEMPLATE_OUTPUTS, f"the stack has no output {output}"


# --- what has been proven -------------------------------------------------------------------

def test_the_word_on_what_never_ran_on_a_gpu_agrees_with_the_benchmarks():
    """Once the GPU check has figures in docs/BENCHMARKS.md, the README must say so, and not before."""
    proven = section("What has been proven, and where")
    benchmarks = (REPO / "docs" / "BENCHMARKS.md").read_text()
    never_ran = "It has never run on a GPU" in benchmarks
    assert ("**Never run on a GPU, over EFA, or in an AWS account.**" in proven) == never_ran
    assert "`bench/gpu.py` has never run" in proven or not never_ran
