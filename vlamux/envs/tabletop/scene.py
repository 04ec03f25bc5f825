"""MJCF of the tabletop scene: a table, a Cartesian arm with a two-finger
gripper, the task's objects and a goal zone, an agent-view and a wrist camera."""

from __future__ import annotations

from vlamux.envs.tabletop.tasks import COLORS

HOME = (0.0, 0.0, 0.22)  # gripper body's world position at joint zero
FINGER_DROP = 0.065  # fingertip bottoms sit this far below the gripper body
OBJECT_SIZE = {"cube": (0.02, 0.02, 0.02), "ball": (0.022,), "block": (0.035, 0.016, 0.016)}
ZONE_HALF = 0.06


def object_half_height(shape: str) -> float:
    return OBJECT_SIZE[shape][-1] if shape != "ball" else OBJECT_SIZE["ball"][0]


def build_xml(objects: list[tuple[str, str]], zone: str | None, image_size: int) -> str:
    geoms = []
    for i, (shape, color) in enumerate(objects):
        r, g, b = COLORS[color]
        kind = "sphere" if shape == "ball" else "box"
        size = " ".join(str(s) for s in OBJECT_SIZE[shape])
        # A ball rolls as a rubber ball on cloth would: rolling friction needs condim 6.
        friction, condim = ("1.5 0.02 0.02", 6) if shape == "ball" else ("1.5 0.02 0.002", 4)
        geoms.append(f"""
    <body name="obj{i}" pos="0 0 0.1">
      <freejoint name="obj{i}"/>
      <geom name="obj{i}" type="{kind}" size="{size}" rgba="{r} {g} {b} 1" mass="0.05" condim="{condim}"
            friction="{friction}"/>
    </body>""")
    zone_xml = ""
    if zone:
        r, g, b = COLORS[zone]
        zone_xml = (f'<geom name="zone" type="box" size="{ZONE_HALF} {ZONE_HALF} 0.0005" pos="0 0.15 0.0005" '
                    f'rgba="{r} {g} {b} 1" contype="0" conaffinity="0"/>')
    hx, hy, hz = HOME
    return f"""
<mujoco model="vlamux_tabletop">
  <option timestep="0.004" integrator="implicitfast"/>
  <visual>
    <quality shadowsize="0" offsamples="0"/>
    <global offwidth="{max(image_size, 64)}" offheight="{max(image_size, 64)}"/>
    <headlight ambient="0.45 0.45 0.45" diffuse="0.5 0.5 0.5"/>
  </visual>
  <default><geom solref="0.005 1"/></default>
  <worldbody>
    <light pos="0.3 -0.3 1.2" dir="-0.3 0.3 -1" directional="true" castshadow="false" diffuse="0.4 0.4 0.4"/>
    <geom name="floor" type="plane" size="2 2 0.1" pos="0 0 -0.3" rgba="0.3 0.3 0.33 1"/>
    <geom name="table" type="box" size="0.35 0.32 0.02" pos="0 0 -0.02" rgba="0.62 0.52 0.42 1"/>
    {zone_xml}
    <camera name="agentview" pos="0 -0.62 0.48" xyaxes="1 0 0 0 0.6 0.8" fovy="50"/>
    <body name="gripper" pos="{hx} {hy} {hz}" gravcomp="1">
      <joint name="gx" type="slide" axis="1 0 0" damping="40" range="-0.28 0.28"/>
      <joint name="gy" type="slide" axis="0 1 0" damping="40" range="-0.26 0.26"/>
      <joint name="gz" type="slide" axis="0 0 1" damping="40" range="-0.21 0.12"/>
      <geom name="palm" type="box" size="0.045 0.015 0.01" rgba="0.2 0.2 0.22 1" mass="0.5"/>
      <geom name="rod" type="cylinder" fromto="0 0 0.01 0 0 0.5" size="0.01" rgba="0.5 0.5 0.55 1"
            contype="0" conaffinity="0" mass="0.01"/>
      <camera name="wrist" pos="0 -0.055 0.01" xyaxes="1 0 0 0 0.94 0.34" fovy="75"/>
      <body name="finger_l" pos="-0.035 0 -0.035" gravcomp="1">
        <joint name="fl" type="slide" axis="1 0 0" range="0 0.03" damping="5"/>
        <geom name="finger_l" type="box" size="0.005 0.014 0.03" rgba="0.25 0.25 0.28 1" mass="0.03"
              condim="4" friction="1.5 0.02 0.002"/>
      </body>
      <body name="finger_r" pos="0.035 0 -0.035" gravcomp="1">
        <joint name="fr" type="slide" axis="-1 0 0" range="0 0.03" damping="5"/>
        <geom name="finger_r" type="box" size="0.005 0.014 0.03" rgba="0.25 0.25 0.28 1" mass="0.03"
              condim="4" friction="1.5 0.02 0.002"/>
      </body>
    </body>{"".join(geoms)}
  </worldbody>
  <actuator>
    <position name="ax" joint="gx" kp="600" ctrlrange="-0.28 0.28"/>
    <position name="ay" joint="gy" kp="600" ctrlrange="-0.26 0.26"/>
    <position name="az" joint="gz" kp="600" ctrlrange="-0.21 0.12"/>
    <position name="afl" joint="fl" kp="300" ctrlrange="0 0.03"/>
    <position name="afr" joint="fr" kp="300" ctrlrange="0 0.03"/>
  </actuator>
</mujoco>"""
