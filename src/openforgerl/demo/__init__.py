"""`make demo`: the main job on one CPU — a student model learns tools-tiny by SFT, then GRPO
(`python -m openforgerl.demo`; the phases: pipeline.py).

- `config.py`: the demo's settings (DemoConfig, QUICK) and the GRPO run they make
- `pipeline.py`: the phases over one run folder (run/folder.py names its files), skipped when done
- `report.py`: report.json's figures and the reward curve; `markdown.py`: report.md
- `command.py`: the command line
"""

from openforgerl.demo.command import demo_config as demo_config
from openforgerl.demo.command import main as main
from openforgerl.demo.command import viewer_line as viewer_line
from openforgerl.demo.config import FAULTS_SUITE as FAULTS_SUITE
from openforgerl.demo.config import QUICK as QUICK
from openforgerl.demo.config import RECIPES as RECIPES
from openforgerl.demo.config import REWORDED_SUITE as REWORDED_SUITE
from openforgerl.demo.config import SUITE as SUITE
from openforgerl.demo.config import DemoConfig as DemoConfig
from openforgerl.demo.config import rl_options as rl_options
from openforgerl.demo.markdown import render_markdown as render_markdown
from openforgerl.demo.pipeline import evaluate_model as evaluate_model
from openforgerl.demo.pipeline import run as run
from openforgerl.demo.report import STEP_KEYS as STEP_KEYS
from openforgerl.demo.report import _paired_gain as _paired_gain
from openforgerl.demo.report import build_report as build_report
from openforgerl.demo.report import plot_rewards as plot_rewards
from openforgerl.demo.report import read_metrics as read_metrics
