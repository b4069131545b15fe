// cmlcluster's JupyterLab extension: a left sidebar panel of every cmlcluster session on this machine.
// What it shows comes from the server extension (cmlcluster/lab), which reads the sessions' records and
// kept logs; the panel itself keeps nothing, so a page reload or a kernel restart changes nothing in it.

import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { LabIcon } from '@jupyterlab/ui-components';

import { SessionsModel } from './model';
import { SessionsPanel } from './panel';

const PANEL_ID = 'cmlcluster-lab-panel';

// Three workers under a session: the panel's icon in the left sidebar.
const ICON_SVG = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 16 16">
  <g class="jp-icon3" fill="#616161">
    <rect x="5" y="1" width="6" height="4" rx="1"/>
    <rect x="1" y="10" width="4" height="4" rx="1"/>
    <rect x="6" y="10" width="4" height="4" rx="1"/>
    <rect x="11" y="10" width="4" height="4" rx="1"/>
    <rect x="7.5" y="5" width="1" height="3"/>
    <rect x="2.5" y="7.5" width="11" height="1"/>
    <rect x="2.5" y="7.5" width="1" height="2.5"/>
    <rect x="12.5" y="7.5" width="1" height="2.5"/>
  </g>
</svg>`;

export const cmlclusterIcon = new LabIcon({ name: 'cmlcluster:sessions', svgstr: ICON_SVG });

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'cmlcluster-lab:panel',
  description: 'The cmlcluster sessions on this machine: workers, Stop, and their logs.',
  autoStart: true,
  optional: [ILayoutRestorer],
  activate: (app: JupyterFrontEnd, restorer: ILayoutRestorer | null) => {
    const open = (path: string) => void app.commands.execute('docmanager:open', { path });
    const panel = new SessionsPanel(new SessionsModel(), open);
    panel.id = PANEL_ID;
    panel.title.icon = cmlclusterIcon;
    panel.title.caption = 'cmlcluster';
    app.shell.add(panel, 'left', { rank: 400 });
    if (restorer) {
      restorer.add(panel, PANEL_ID); // open again after a page reload if it was open
    }
  }
};

export default plugin;
