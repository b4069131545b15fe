// What the panel shows, fetched from the server extension (cmlcluster/lab/handlers.py) while the panel is
// visible. The view (panel.tsx) only draws this; every action goes through the REST API, so whatever
// the panel says is what the server read from the sessions' own records, never a guess of the page's.

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

export const POLL_MS = 1500;
export const LOG_BYTES = 64 * 1024;

export interface IGpu {
  index: number;
  utilization_percent: number | null;
  memory_bytes: number | null;
  memory_total_bytes: number | null;
}

export interface IUsage {
  cpu_percent: number;
  memory_bytes: number;
  memory_limit_bytes: number | null;
  gpus: IGpu[];
  sampled_at: number;
}

export interface INotebook {
  name: string; // as shown
  path: string | null; // as JupyterLab opens it; null outside its root, or for a script or a terminal
}

export interface ILiveWorker {
  id: string;
  label: string;
  status: string;
  host: string;
  exit_code: number | null;
  usage: IUsage | null;
  // What it asked for and uses, in the words of the session's widget (the server's ui/model.py).
  cpu_text: string;
  memory_text: string;
  gpu_text: string;
}

export interface ILiveSession {
  id: string;
  state: 'alive' | 'gone' | 'answering' | 'elsewhere';
  notebook: INotebook;
  backend: string;
  started: number;
  pid: number;
  can_stop: boolean;
  logs_kept: boolean; // false: CMLCLUSTER_KEEP_LOGS=0, its logs go with it and the panel shows none
  workers: ILiveWorker[];
}

export interface IKeptWorker {
  id: string;
  label: string;
  status: string | null;
  exit_code: number | null;
  log: boolean;
}

export interface IKeptSession {
  id: string;
  state: 'closed' | 'died' | 'unknown';
  notebook: INotebook;
  backend: string | null;
  started: number | null;
  ended: number | null;
  last_seen: number;
  outcome: string;
  size: number;
  workers: IKeptWorker[];
}

export interface ISnapshot {
  now: number;
  live: ILiveSession[];
  kept: IKeptSession[];
}

export interface ILogView {
  session: string;
  worker: string;
  label: string;
  text: string;
  size: number;
  truncated: boolean;
  error: string;
}

export const ENDED = ['succeeded', 'failed', 'stopped'];

export class SessionsModel {
  snapshot: ISnapshot | null = null;
  error = ''; // the last request's failure, shown at the panel's top
  notice = ''; // what the last action did (cleanup's lines)
  log: ILogView | null = null;

  private _changed = new Signal<this, void>(this);
  private _timer = 0;
  private _polling = false; // a poll in flight: a slow snapshot never has the next one start beside it
  private _settings = ServerConnection.makeSettings();

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  // Poll while the panel is visible: a hidden panel costs the server nothing.
  start(): void {
    if (!this._timer) {
      this._timer = window.setInterval(() => void this._poll(), POLL_MS);
      void this._poll();
    }
  }

  stop(): void {
    window.clearInterval(this._timer);
    this._timer = 0;
  }

  private async _poll(): Promise<void> {
    if (this._polling) {
      return; // the last one is still waiting for the server: skip this tick
    }
    this._polling = true;
    try {
      await this.refresh();
    } finally {
      this._polling = false;
    }
  }

  async refresh(): Promise<void> {
    try {
      this.snapshot = await this._request<ISnapshot>('sessions');
      this.error = '';
      if (this.log) {
        await this._readLog(this.log.session, this.log.worker, this.log.label);
      }
    } catch (e) {
      this.error = `cmlcluster: ${String((e as Error).message || e)}`;
    }
    this._changed.emit();
  }

  async stopWorkers(session: string, workers: string[] | 'all'): Promise<void> {
    await this._act(() =>
      this._request(`sessions/${session}/stop`, { method: 'POST', body: JSON.stringify({ workers }) })
    );
  }

  async cleanup(): Promise<void> {
    await this._act(async () => {
      const reply = await this._request<{ done: string[] }>('cleanup', { method: 'POST', body: '{}' });
      this.notice = reply.done.length ? reply.done.join('\n') : 'nothing to clean up';
    });
  }

  async showLog(session: string, worker: string, label: string): Promise<void> {
    this.log = { session, worker, label, text: '', size: 0, truncated: false, error: '' };
    await this._readLog(session, worker, label);
    this._changed.emit();
  }

  hideLog(): void {
    this.log = null;
    this._changed.emit();
  }

  // The log is the view's only while that worker's log is still the one shown: one closed, or replaced
  // by another worker's, while this read was in flight stays as the user left it.
  private async _readLog(session: string, worker: string, label: string): Promise<void> {
    let read: ILogView;
    try {
      const tail = await this._request<{ text: string; size: number; truncated: boolean }>(
        `logs/${session}/${worker}?bytes=${LOG_BYTES}`
      );
      read = { session, worker, label, ...tail, error: '' };
    } catch (e) {
      read = { session, worker, label, text: '', size: 0, truncated: false, error: String((e as Error).message) };
    }
    if (this.log && this.log.session === session && this.log.worker === worker) {
      this.log = read;
    }
  }

  private async _act(action: () => Promise<unknown>): Promise<void> {
    try {
      await action();
      this.error = '';
    } catch (e) {
      this.error = `cmlcluster: ${String((e as Error).message || e)}`;
    }
    await this.refresh();
  }

  private async _request<T>(path: string, init: RequestInit = {}): Promise<T> {
    const url = URLExt.join(this._settings.baseUrl, 'cmlcluster', path);
    const response = await ServerConnection.makeRequest(url, init, this._settings);
    const text = await response.text();
    const body = text ? JSON.parse(text) : {};
    if (!response.ok) {
      throw new Error(body.message || `${response.status} ${response.statusText}`);
    }
    return body as T;
  }
}
