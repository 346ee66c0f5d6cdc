"""A real SLURM cluster on this machine for tests: Debian's slurmctld/slurmd (installed with
apt-get when missing; root required), two pseudo-nodes n1 (127.0.0.1) and n2 (127.0.0.2) with
8 fake GPUs each (gres files that are /dev/null), no munge, no systemd. All state lives under a
scratch directory; `stop()` kills the daemons by pid."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]


def install() -> None:
    missing = [tool for tool in ("slurmctld", "slurmd", "sbatch", "shellcheck") if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise RuntimeError(
            f"{missing} missing and installing them needs root (apt-get install {' '.join(PACKAGES)})"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES, "shellcheck"],
                   check=True, env=env, capture_output=True)  # fmt: skip


def slurm_conf(root: Path, port: int) -> str:
    return f"""ClusterName=megatronrl
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
PlugStackConfig={root}/etc/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
SchedulerParameters=sched_interval=1,bf_interval=1
KillWait=5
InactiveLimit=0
MinJobAge=4
NodeName=n1 NodeAddr=127.0.0.1 NodeHostname=localhost Port={port + 1} CPUs=8 Sockets=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=1000 Gres=gpu:8 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.2 NodeHostname=localhost Port={port + 2} CPUs=8 Sockets=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=1000 Gres=gpu:8 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
"""


class LocalSlurm:
    def __init__(self, root: Path, port: int = 16917):
        self.root = Path(root)
        install()
        for sub in ("etc", "state", "spool/n1", "spool/n2", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for i in range(8):
            device = self.root / f"fakegpu{i}"
            if not device.exists():
                os.mknod(device, 0o666 | 0o020000, os.makedev(1, 3))  # the device of /dev/null
        (self.root / "etc" / "slurm.conf").write_text(slurm_conf(self.root, port))
        (self.root / "etc" / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName=n[1-2] Name=gpu File={self.root}/fakegpu[0-7]\n"
        )
        (self.root / "etc" / "plugstack.conf").write_text("")
        self.env = {**os.environ, "SLURM_CONF": str(self.root / "etc" / "slurm.conf")}
        self.daemons = []
        for command, log in [(["slurmctld", "-D"], "slurmctld.out"), (["slurmd", "-D", "-N", "n1"], "slurmd-n1.out"),
                             (["slurmd", "-D", "-N", "n2"], "slurmd-n2.out")]:  # fmt: skip
            with open(self.root / "log" / log, "w") as out:
                self.daemons.append(subprocess.Popen(command, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                                                     stderr=subprocess.STDOUT))  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            states = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True
            )
            if states.stdout.count(" idle") == 2:
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"local SLURM not ready; logs in {self.root / 'log'}")

    def sbatch_wait(self, script: Path, timeout_s: float = 900) -> tuple[int, str]:
        """(exit code, job id) of `sbatch --wait SCRIPT`."""
        result = subprocess.run(["sbatch", "--wait", "--parsable", str(script)], env=self.env, capture_output=True,
                                text=True, timeout=timeout_s)  # fmt: skip
        job_id = result.stdout.strip().split(";")[0].splitlines()[0] if result.stdout.strip() else ""
        return result.returncode, job_id

    def stop(self) -> None:
        for daemon in self.daemons:
            daemon.terminate()
        for daemon in self.daemons:
            try:
                daemon.wait(15)
            except subprocess.TimeoutExpired:
                daemon.kill()
