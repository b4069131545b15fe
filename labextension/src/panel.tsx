// The left sidebar panel: live sessions (their workers, Stop), gone ones (Clean up), kept ones (outcome,
// logs). It draws the model and forwards clicks to it; nothing here keeps state of its own.

import { ReactWidget, UseSignal } from '@jupyterlab/ui-components';
import { Message } from '@lumino/messaging';
import * as React from 'react';

import { ENDED, IKeptSession, ILiveSession, ILiveWorker, INotebook, SessionsModel } from './model';

export type OpenNotebook = (path: string) => void;

export class SessionsPanel extends ReactWidget {
  constructor(
    readonly model: SessionsModel,
    private _open: OpenNotebook
  ) {
    super();
    this.addClass('cmlcluster-lab-panel');
  }

  protected onAfterShow(msg: Message): void {
    this.model.start();
  }

  protected onAfterHide(msg: Message): void {
    this.model.stop();
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    if (this.isVisible) {
      this.model.start();
    }
  }

  dispose(): void {
    this.model.stop();
    super.dispose();
  }

  render(): JSX.Element {
    return (
      <UseSignal signal={this.model.changed}>
        {() => <Sessions model={this.model} open={this._open} />}
      </UseSignal>
    );
  }
}

function Sessions(props: { model: SessionsModel; open: OpenNotebook }): JSX.Element {
  const { model, open } = props;
  const snapshot = model.snapshot;
  if (!snapshot) {
    return <div className="cmlcluster-lab-note">{model.error || 'reading the sessions…'}</div>;
  }
  const live = snapshot.live.filter(s => s.state !== 'gone');
  const gone = snapshot.live.filter(s => s.state === 'gone');
  return (
    <div>
      <h2 className="cmlcluster-lab-title">cmlcluster</h2>
      {model.error && <div className="cmlcluster-lab-error">{model.error}</div>}
      {model.notice && <pre className="cmlcluster-lab-notice">{model.notice}</pre>}
      <h3>Live sessions</h3>
      {live.length === 0 && <div className="cmlcluster-lab-note">none on this machine</div>}
      {live.map(s => (
        <Live key={s.id} session={s} now={snapshot.now} model={model} open={open} />
      ))}
      {gone.length > 0 && (
        <>
          <h3>
            Gone sessions{' '}
            <button className="jp-mod-styled jp-mod-warn cmlcluster-lab-cleanup" onClick={() => void model.cleanup()}>
              Clean up
            </button>
          </h3>
          <div className="cmlcluster-lab-note">
            Their process ended without closing: Clean up ends what they left (workers, folders, containers).
          </div>
          {gone.map(s => (
            <div key={s.id} className="cmlcluster-lab-session cmlcluster-lab-gone" data-session={s.id} data-state={s.state}>
              <Heading notebook={s.notebook} open={open} details={`${s.backend} · pid ${s.pid} gone`} />
              <div className="cmlcluster-lab-note">
                {s.workers.map(w => `${w.label} ${w.status}`).join(', ') || 'no workers'} when last recorded
              </div>
            </div>
          ))}
        </>
      )}
      <h3>Kept sessions</h3>
      {snapshot.kept.length === 0 && <div className="cmlcluster-lab-note">no worker logs kept</div>}
      {snapshot.kept.map(s => (
        <Kept key={s.id} session={s} model={model} open={open} />
      ))}
    </div>
  );
}

function Heading(props: { notebook: INotebook; open: OpenNotebook; details: string }): JSX.Element {
  const { notebook, open, details } = props;
  const path = notebook.path;
  return (
    <div className="cmlcluster-lab-heading">
      {path ? (
        <a className="cmlcluster-lab-notebook" title={`open ${path}`} onClick={() => open(path)}>
          {notebook.name}
        </a>
      ) : (
        <span className="cmlcluster-lab-notebook">{notebook.name}</span>
      )}
      <span className="cmlcluster-lab-details"> · {details}</span>
    </div>
  );
}

const STATE_NOTES: { [state: string]: string } = {
  answering: 'its process looks gone, but its controller answers',
  elsewhere: 'of another machine, container or boot: shown, never stopped from here'
};

function Live(props: { session: ILiveSession; now: number; model: SessionsModel; open: OpenNotebook }): JSX.Element {
  const { session, now, model, open } = props;
  const unfinished = session.workers.filter(w => !ENDED.includes(w.status));
  return (
    <div className="cmlcluster-lab-session" data-session={session.id} data-state={session.state}>
      <Heading
        notebook={session.notebook}
        open={open}
        details={`${session.backend} · up ${duration(now - session.started)}`}
      />
      {STATE_NOTES[session.state] && <div className="cmlcluster-lab-note">{STATE_NOTES[session.state]}</div>}
      <table className="cmlcluster-lab-workers">
        <thead>
          <tr>
            <th>worker</th>
            <th>status</th>
            <th>host</th>
            <th>CPU</th>
            <th>memory</th>
            <th>GPU</th>
            <th />
          </tr>
        </thead>
        <tbody>
          {session.workers.map(w => (
            <WorkerRow key={w.id} session={session} worker={w} model={model} />
          ))}
        </tbody>
      </table>
      {session.can_stop && (
        <button
          className="jp-mod-styled jp-mod-warn cmlcluster-lab-stop-all"
          disabled={unfinished.length === 0}
          onClick={() => void model.stopWorkers(session.id, 'all')}
        >
          Stop all
        </button>
      )}
      <LogView session={session.id} model={model} />
    </div>
  );
}

function WorkerRow(props: { session: ILiveSession; worker: ILiveWorker; model: SessionsModel }): JSX.Element {
  const { session, worker, model } = props;
  return (
    <tr data-worker={worker.id} data-status={worker.status}>
      <td title={worker.id}>{worker.label}</td>
      <td
        className={`cmlcluster-lab-status cmlcluster-lab-${worker.status}`}
        title={worker.exit_code === null ? '' : `exit code ${worker.exit_code}`}
      >
        {worker.status}
      </td>
      <td>{worker.host}</td>
      <td className="cmlcluster-lab-cpu">{worker.cpu_text}</td>
      <td className="cmlcluster-lab-memory">{worker.memory_text}</td>
      <td className="cmlcluster-lab-gpu">{worker.gpu_text || '–'}</td>
      <td className="cmlcluster-lab-actions">
        {session.can_stop && !ENDED.includes(worker.status) && (
          <button className="jp-mod-styled jp-mod-warn" onClick={() => void model.stopWorkers(session.id, [worker.id])}>
            Stop
          </button>
        )}
        {session.logs_kept && (
          <button className="jp-mod-styled" onClick={() => void model.showLog(session.id, worker.id, worker.label)}>
            log
          </button>
        )}
      </td>
    </tr>
  );
}

const KEPT_NOTES: { [state: string]: string } = {
  died: 'died: its process ended without closing',
  unknown: 'of an older cmlcluster: no summary kept'
};

function Kept(props: { session: IKeptSession; model: SessionsModel; open: OpenNotebook }): JSX.Element {
  const { session, model, open } = props;
  const end = session.ended ?? session.last_seen;
  const took = session.started ? `${session.ended ? '' : '~'}${duration(end - session.started)}` : '?';
  const when = new Date(end * 1000).toLocaleString();
  return (
    <div className="cmlcluster-lab-session cmlcluster-lab-kept" data-session={session.id} data-state={session.state}>
      <Heading notebook={session.notebook} open={open} details={`${session.backend ?? '?'} · ${took}`} />
      <div className="cmlcluster-lab-outcome">
        {KEPT_NOTES[session.state] ? `${KEPT_NOTES[session.state]} · ` : ''}
        {session.outcome} · {session.ended ? 'ended' : 'last seen'} {when}
      </div>
      <div className="cmlcluster-lab-kept-workers">
        {session.workers.map(w => (
          <span key={w.id} className="cmlcluster-lab-kept-worker" data-worker={w.id} data-status={w.status ?? ''}>
            {w.label}: <span className={`cmlcluster-lab-status cmlcluster-lab-${w.status}`}>{w.status ?? '?'}</span>{' '}
            {w.log && (
              <button className="jp-mod-styled" onClick={() => void model.showLog(session.id, w.id, w.label)}>
                log
              </button>
            )}
          </span>
        ))}
      </div>
      <LogView session={session.id} model={model} />
    </div>
  );
}

function LogView(props: { session: string; model: SessionsModel }): JSX.Element | null {
  const { session, model } = props;
  const log = model.log;
  if (!log || log.session !== session) {
    return null;
  }
  const kib = (log.size / 1024).toFixed(1);
  return (
    <div className="cmlcluster-lab-log" data-worker={log.worker}>
      <div className="cmlcluster-lab-log-heading">
        {log.label}'s log {log.truncated ? `(its last 64 KiB of ${kib} KiB)` : `(${kib} KiB)`}{' '}
        <button className="jp-mod-styled" onClick={() => model.hideLog()}>
          close
        </button>
      </div>
      {log.error ? <div className="cmlcluster-lab-error">{log.error}</div> : <pre>{log.text}</pre>}
    </div>
  );
}

export function duration(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) {
    return `${s} s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)} min ${String(s % 60).padStart(2, '0')} s`;
  }
  return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, '0')} min`;
}
