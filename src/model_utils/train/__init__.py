"""Training, the top layer: loop.py is the loop, read top to bottom (step, log, evaluate, agree, judge the update, save
or stop, finish); step.py one optimizer step and its inputs; tracking.py what the loop keeps between steps (the log
interval, non-finite steps, the save schedule, the data trace); build.py a run built from its checked plan (data,
model, engine); resume.py a checkpoint loaded into it; run.py the Run they share. Imports every layer below.
"""
